"""Evaluation split across JAX processes: each process evaluates its share of the rows, and
2 processes x 4 CPU devices give the validation and test values of 1 process x 8 devices.

The splits have odd row counts (101 and 51), so the processes' shards are evened out by a
repeated row, which must not count, and the last batches are ragged. The two processes run
this file as a script (``python -m tests.torchshell.test_multiprocess_eval RANK PORT OUT``);
the one-process baseline runs in the test process (8 devices, see conftest.py).
"""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import quiet_env

N_VAL, N_TEST = 101, 51  # rows of the digits splits below (1,797 x fraction, rounded down)
FRACTIONS = {"val_fraction": 0.0563, "test_fraction": 0.0285}
EVAL_BATCH = 16  # rows per process and batch


def _evaluate(batch_size: int) -> dict[str, Any]:
    """One training step of a digits MLP (seed 0; ``batch_size`` rows per process) with
    validation inside fit, then ``validate`` and ``test``, on this process's devices: the
    values of each pass, and the rows each split's dataset handed out here (``{split rows:
    rows read}``)."""
    import jaxcore
    from jaxcore.models.digits import MLP
    from tests.helpers import quiet_trainer
    from torchshell import JaxModule
    from torchshell.data.digits import DigitsDataModule, DigitsDataset

    read: Counter[int] = Counter()
    gather = DigitsDataset.__getitems__

    def counting(self: DigitsDataset, indices: list[int]) -> Any:
        read[len(self)] += len(indices)
        return gather(self, indices)

    DigitsDataset.__getitems__ = counting  # type: ignore[method-assign]
    try:
        module = JaxModule(
            MLP(features=(16,)),
            jaxcore.softmax_cross_entropy,
            jaxcore.make_optimizer(lr=1e-2),
            mesh=jaxcore.make_mesh({"data": -1}),
            print_summary=False,
        )
        data = DigitsDataModule(batch_size=batch_size, eval_batch_size=EVAL_BATCH, **FRACTIONS)
        trainer = quiet_trainer(
            max_steps=1, val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=0
        )
        trainer.fit(module, data)
        fit = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        val = trainer.validate(module, data, verbose=False)[0]
        test = trainer.test(module, data, verbose=False)[0]
    finally:
        DigitsDataset.__getitems__ = gather  # type: ignore[method-assign]
    evaluated = {str(k): read[k] for k in (N_VAL, N_TEST)}  # (not the training split)
    return {"fit": fit, "val": val, "test": test, "read": evaluated}


def _child(rank: int, port: int, out: Path) -> None:
    from torchshell.distributed import initialize

    address = f"127.0.0.1:{port}"
    initialize(
        coordinator=address,
        num_processes=2,
        process_id=rank,
        bind_address=address,
        heartbeat_timeout_s=30,
        init_timeout_s=120,
    )
    out.write_text(json.dumps(_evaluate(batch_size=8)))  # 2 x 8: the global 16


@pytest.mark.timeout(600)
def test_two_processes_split_evaluation_and_match_one_process(tmp_path: Path):
    from torchshell.app.launch import child_env, free_port

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    procs, logs = [], []
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").open("w")
        logs.append(log)
        cmd = [sys.executable, "-m", "tests.torchshell.test_multiprocess_eval"]
        cmd += [str(rank), str(port), str(tmp_path / f"rank{rank}.json")]
        env = child_env(quiet_env(), 4)
        procs.append(subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        alone = _evaluate(batch_size=16)  # meanwhile, 1 process x 8 devices here
        codes = [p.wait(timeout=500) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for log in logs:
            log.close()
    text = [(tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2)]
    assert codes == [0, 0], text
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # one process reads every row once per pass (validation twice: in fit, then validate);
    # each of two reads its half (rounded up: one of them reads a repeated row to even out
    # the shards, and that row must not count)
    assert alone["read"] == {str(N_VAL): 2 * N_VAL, str(N_TEST): N_TEST}
    for got in ranks:
        assert got["read"] == {str(N_VAL): 2 * -(-N_VAL // 2), str(N_TEST): -(-N_TEST // 2)}
    checked = [("fit", ("val/loss", "val/accuracy")), ("val", ("val/loss", "val/accuracy"))]
    for split, names in [*checked, ("test", ("test/loss",))]:
        assert sorted(alone[split]) == sorted(ranks[0][split])
        for name in names:
            assert name in alone[split], sorted(alone[split])
        for name, value in alone[split].items():
            for got in ranks:  # every process reports the same global means
                np.testing.assert_allclose(got[split][name], value, rtol=1e-6, err_msg=name)


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))

"""The model zoo: public models at tiny random-init configs (no downloads), with batches.

Every entry builds a fresh module (same seed, same weights) and its batches. Dropout, layer
drop, stochastic depth and SpecAugment-style masking are set to 0 here: parity against
torch needs the same randomness, and the two frameworks draw differently (the random
patterns themselves are tested in tests/torchshell/test_torch_patterns.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random init only: never a download

import torch
from torch import nn

B = 2  # rows per batch (one JAX device in the zoo)
# Images are 64x64 and the vision nets train at lr 0.01: at 32x32 the last stages are 1x1, so
# BatchNorm normalises 2 values to exactly +-1, the input gradient there is float noise, and
# both frameworks amplify their own noise apart (the losses part after one step).


@dataclass
class Entry:
    name: str
    source: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    inputs: tuple[str, ...]
    kind: str = "ce"  # ce: labels y; l2: mean square of the outputs
    pick: Callable[[Any], Any] = field(default=lambda o: o)
    trainer: bool = False  # also a train + val step under the real Lightning Trainer
    kwargs: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.05
    # BatchNorm layers kept in eval mode (running statistics, no update) in both frameworks:
    # for nets that are chaotic under train-mode BatchNorm at a tiny batch (docs/zoo.md)
    eval_bn: bool = False


_EVAL_BN: dict[type, type] = {}


def _stay_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(self, False)


def eval_batchnorm(net: nn.Module) -> nn.Module:
    """``net`` with every BatchNorm layer in eval mode for good: ``net.train()`` (as the
    tracer and the torch reference call it) leaves them normalising with their running
    statistics, which then stay as initialised. Returns ``net`` itself."""
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            cls = type(m)
            m.__class__ = _EVAL_BN.setdefault(
                cls, type(f"Eval{cls.__name__}", (cls,), {"train": _stay_eval})
            )
            m.eval()
    return net


def _img(size: int = 64, classes: int = 10, rows: int = B) -> Callable[[torch.Generator], dict]:
    return lambda g: {
        "x": torch.randn(rows, 3, size, size, generator=g),
        "y": torch.randint(0, classes, (rows,), generator=g),
    }


def _tokens(vocab: int = 64, t: int = 8, classes: int | None = None, pad: bool = True):
    def make(g: torch.Generator) -> dict[str, torch.Tensor]:
        x = torch.randint(1, vocab, (B, t), generator=g)
        am = torch.ones(B, t, dtype=torch.long)
        if pad:
            am[1, t - 2 :] = 0
        y = torch.randint(0, classes or vocab, (B,) if classes else (B, t), generator=g)
        return {"x": x, "am": am, "y": y}

    return make


def _rows(**shapes: tuple[int, ...]) -> Callable[[torch.Generator], dict]:
    def make(g: torch.Generator) -> dict[str, torch.Tensor]:
        out = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
        out["y"] = torch.zeros(B, dtype=torch.long)
        return out

    return make


class Kw(nn.Module):
    """Calls ``model`` with the batch inputs as keyword arguments (``names``), plus ``extra``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], **extra: Any) -> None:
        super().__init__()
        self.model, self.names, self.extra = model, names, extra

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, args, strict=True)), **self.extra)


# -- stock torch -------------------------------------------------------------------------
class CausalLM(nn.Module):
    """nn.Transformer with its causal masks built from shapes in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.tf = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.emb(x)
        return self.head(self.tf(h, h, src_mask=mask, tgt_mask=mask))


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder (nested-tensor fast path enabled) with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        h = self.enc(x, src_key_padding_mask=am == 0)
        return self.head(h.mean(1))


def _stock() -> list[Entry]:
    from lightning.pytorch.demos import Transformer

    def seq(g):
        return {
            "x": torch.randn(B, 6, 8, generator=g),
            "y": torch.zeros(B, dtype=torch.long),
        }

    def enc(g):
        am = torch.ones(B, 6, dtype=torch.long)
        am[1, 4:] = 0
        return {"x": torch.randn(B, 6, 16, generator=g), "am": am, "y": torch.tensor([1, 3])}

    def mha(g):
        return {**enc(g), "m": enc(g)["am"] == 0}

    def demo(g):
        x = torch.randint(0, 50, (B, 8), generator=g)
        return {"x": x, "t": x.roll(-1, 1), "y": x.roll(-1, 1)}

    first = lambda o: o[0]  # noqa: E731
    return [
        Entry(
            "nn.Transformer (causal masks from shapes)",
            "torch",
            CausalLM,
            _tokens(pad=False),
            ("x",),
            trainer=True,
        ),
        Entry(
            "nn.TransformerEncoder + key padding mask",
            "torch",
            PaddedEncoder,
            enc,
            ("x", "am"),
            trainer=True,
        ),
        Entry(
            "nn.MultiheadAttention + key padding mask",
            "torch",
            lambda: nn.MultiheadAttention(16, 2, batch_first=True),
            mha,
            ("x", "x", "x", "m"),
            "l2",
            first,
        ),
        Entry(
            "nn.LSTM (2 layers)",
            "torch",
            lambda: nn.LSTM(8, 16, 2, batch_first=True),
            seq,
            ("x",),
            "l2",
            first,
            trainer=True,
        ),
        Entry(
            "nn.GRU (bidirectional)",
            "torch",
            lambda: nn.GRU(8, 16, batch_first=True, bidirectional=True),
            seq,
            ("x",),
            "l2",
            first,
        ),
        Entry(
            "lightning demos.Transformer",
            "lightning",
            lambda: Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0),
            demo,
            ("x", "t"),
            trainer=True,
        ),
    ]


# -- torchvision ---------------------------------------------------------------------------
def _vision() -> list[Entry]:
    import torchvision.models as tvm
    from torchvision.models.convnext import CNBlockConfig
    from torchvision.models.regnet import BlockParams
    from torchvision.models.resnet import BasicBlock

    entries = [
        Entry(
            "resnet (BasicBlock, [1,1,1,1]; batch 8, 32px)",
            "torchvision",
            lambda: tvm.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10),
            _img(32, rows=8),
            ("x",),
            trainer=True,
        ),
        Entry(
            "mobilenet_v3_small",
            "torchvision",
            lambda: tvm.mobilenet_v3_small(num_classes=10, dropout=0.0),
            _img(),
            ("x",),
        ),
        Entry(
            "mobilenet_v2 (width 0.25; BatchNorm in eval mode, 32px)",
            "torchvision",
            lambda: tvm.mobilenet_v2(num_classes=10, width_mult=0.25, dropout=0.0),
            _img(32),
            ("x",),
            eval_bn=True,
        ),
        Entry(
            "efficientnet_b0 (BatchNorm in eval mode, 32px)",
            "torchvision",
            lambda: tvm.efficientnet_b0(num_classes=10, dropout=0.0, stochastic_depth_prob=0.0),
            _img(32),
            ("x",),
            eval_bn=True,
        ),
        Entry(
            "convnext (2 stages, width 16)",
            "torchvision",
            lambda: tvm.ConvNeXt(
                [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                stochastic_depth_prob=0.0,
                num_classes=10,
            ),
            _img(),
            ("x",),
        ),
        Entry(
            "vit (32px, patch 8, 2 layers)",
            "torchvision",
            lambda: tvm.VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=10),
            _img(32),
            ("x",),
        ),
        Entry(
            "regnet (depth 2, width 8)",
            "torchvision",
            lambda: tvm.RegNet(BlockParams.from_init_params(2, 8, 8.0, 2.0, 8), num_classes=10),
            _img(),
            ("x",),
        ),
        Entry(
            "squeezenet1_1",
            "torchvision",
            lambda: tvm.squeezenet1_1(num_classes=10, dropout=0.0),
            _img(),
            ("x",),
        ),
        Entry(
            "shufflenet_v2_x0_5 (BatchNorm in eval mode, 32px)",
            "torchvision",
            lambda: tvm.shufflenet_v2_x0_5(num_classes=10),
            _img(32),
            ("x",),
            eval_bn=True,
        ),
        Entry(
            "densenet (growth 8, blocks (2,2))",
            "torchvision",
            lambda: tvm.DenseNet(8, (2, 2), 16, num_classes=10),
            _img(),
            ("x",),
        ),
    ]
    for e in entries:
        e.lr = 0.01
    return entries


# -- torchaudio ----------------------------------------------------------------------------
def _wav2vec2(**kw: Any) -> nn.Module:
    import torchaudio

    cfg = dict(
        extractor_mode="group_norm",
        extractor_conv_layer_config=[(16, 10, 5), (16, 3, 2)],
        extractor_conv_bias=False,
        encoder_embed_dim=32,
        encoder_projection_dropout=0.0,
        encoder_pos_conv_kernel=16,
        encoder_pos_conv_groups=4,
        encoder_num_layers=2,
        encoder_num_heads=2,
        encoder_attention_dropout=0.0,
        encoder_ff_interm_features=64,
        encoder_ff_interm_dropout=0.0,
        encoder_dropout=0.0,
        encoder_layer_norm_first=False,
        encoder_layer_drop=0.0,
        aux_num_out=10,
    )
    cfg.update(kw)
    return torchaudio.models.wav2vec2_model(**cfg)


def _audio() -> list[Entry]:
    import torchaudio.models as tam

    def lengths(g):
        return {
            "x": torch.randn(B, 10, 16, generator=g),
            "n": torch.tensor([10, 7]),
            "y": torch.zeros(B, dtype=torch.long),
        }

    def emformer(g):
        return {
            "x": torch.randn(B, 9, 16, generator=g),
            "n": torch.tensor([8, 6]),
            "y": torch.zeros(B, dtype=torch.long),
        }

    first = lambda o: o[0]  # noqa: E731
    return [
        Entry(
            "Wav2Letter (mfcc)",
            "torchaudio",
            lambda: tam.Wav2Letter(num_classes=10, input_type="mfcc", num_features=16),
            _rows(x=(B, 16, 20)),
            ("x",),
            "l2",
            trainer=True,
        ),
        Entry(
            "DeepSpeech",
            "torchaudio",
            lambda: tam.DeepSpeech(16, 32, 10, dropout=0.0),
            _rows(x=(B, 1, 12, 16)),
            ("x",),
            "l2",
        ),
        Entry(
            "Conformer (lengths -> padding mask)",
            "torchaudio",
            lambda: tam.Conformer(16, 2, 32, 1, 3),
            lengths,
            ("x", "n"),
            "l2",
            first,
        ),
        Entry(
            "wav2vec2_model (group norm, post-LN)",
            "torchaudio",
            _wav2vec2,
            _rows(x=(B, 400)),
            ("x",),
            "l2",
            first,
            trainer=True,
        ),
        Entry(
            "wav2vec2_model (hubert-large style: layer norm, pre-LN)",
            "torchaudio",
            lambda: _wav2vec2(extractor_mode="layer_norm", encoder_layer_norm_first=True),
            _rows(x=(B, 400)),
            ("x",),
            "l2",
            first,
        ),
        Entry(
            "Emformer",
            "torchaudio",
            lambda: tam.Emformer(16, 2, 32, 1, segment_length=4, right_context_length=1),
            emformer,
            ("x", "n"),
            "l2",
            first,
        ),
        Entry(
            "ConvTasNet",
            "torchaudio",
            lambda: tam.ConvTasNet(2, 4, 16, 3, 8, 16, 2, 1),
            _rows(x=(B, 1, 64)),
            ("x",),
            "l2",
        ),
    ]


# -- transformers --------------------------------------------------------------------------
def _hf() -> list[Entry]:
    import transformers as hf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    nodrop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    logits = lambda o: o["logits"]  # noqa: E731
    hidden = lambda o: o["last_hidden_state"]  # noqa: E731

    def t5(g):
        b = _tokens()(g)
        return {**b, "dx": b["y"]}

    def whisper(g):
        return {"x": torch.randn(B, 16, 32, generator=g), "y": torch.zeros(B, dtype=torch.long)}

    def w2v(g):
        return {"x": torch.randn(B, 400, generator=g), "y": torch.tensor([0, 2])}

    def vit_cfg():
        return hf.ViTConfig(image_size=32, patch_size=8, num_labels=10, **small, **nodrop)

    return [
        Entry(
            "BertForSequenceClassification",
            "transformers",
            lambda: hf.BertForSequenceClassification(
                hf.BertConfig(
                    vocab_size=64, max_position_embeddings=32, num_labels=3, **small, **nodrop
                )
            ),
            _tokens(classes=3),
            ("x", "am"),
            "ce",
            logits,
            trainer=True,
        ),
        Entry(
            "GPT2LMHeadModel (tied embeddings)",
            "transformers",
            lambda: Kw(
                hf.GPT2LMHeadModel(
                    hf.GPT2Config(
                        vocab_size=64,
                        n_positions=32,
                        n_embd=32,
                        n_layer=2,
                        n_head=2,
                        resid_pdrop=0.0,
                        embd_pdrop=0.0,
                        attn_pdrop=0.0,
                    )
                ),
                ("input_ids", "attention_mask"),
                use_cache=False,
            ),
            _tokens(),
            ("x", "am"),
            "ce",
            logits,
        ),
        Entry(
            "T5ForConditionalGeneration",
            "transformers",
            lambda: Kw(
                hf.T5ForConditionalGeneration(
                    hf.T5Config(
                        vocab_size=64,
                        d_model=32,
                        d_kv=16,
                        d_ff=64,
                        num_layers=1,
                        num_heads=2,
                        dropout_rate=0.0,
                        decoder_start_token_id=0,
                    )
                ),
                ("input_ids", "attention_mask", "decoder_input_ids"),
                use_cache=False,
            ),
            t5,
            ("x", "am", "dx"),
            "ce",
            logits,
        ),
        Entry(
            "ViTForImageClassification",
            "transformers",
            lambda: hf.ViTForImageClassification(vit_cfg()),
            _img(32),
            ("x",),
            "ce",
            logits,
        ),
        Entry(
            "BeitForImageClassification (memoized relative position index)",
            "transformers",
            lambda: hf.BeitForImageClassification(
                hf.BeitConfig(
                    image_size=32,
                    patch_size=8,
                    num_labels=10,
                    use_relative_position_bias=True,
                    **small,
                    **nodrop,
                )
            ),
            _img(32),
            ("x",),
            "ce",
            logits,
        ),
        Entry(
            "Whisper encoder",
            "transformers",
            lambda: (
                hf.WhisperModel(
                    hf.WhisperConfig(
                        pad_token_id=0,
                        bos_token_id=1,
                        eos_token_id=2,
                        decoder_start_token_id=1,
                        d_model=32,
                        encoder_layers=2,
                        encoder_attention_heads=2,
                        decoder_layers=1,
                        decoder_attention_heads=2,
                        encoder_ffn_dim=64,
                        decoder_ffn_dim=64,
                        num_mel_bins=16,
                        max_source_positions=16,
                        vocab_size=64,
                        dropout=0.0,
                        attention_dropout=0.0,
                    )
                ).encoder
            ),
            whisper,
            ("x",),
            "l2",
            hidden,
        ),
        Entry(
            "Wav2Vec2ForSequenceClassification",
            "transformers",
            lambda: hf.Wav2Vec2ForSequenceClassification(
                hf.Wav2Vec2Config(
                    conv_dim=(16, 16),
                    conv_stride=(5, 2),
                    conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16,
                    num_conv_pos_embedding_groups=4,
                    num_labels=3,
                    layerdrop=0.0,
                    mask_time_prob=0.0,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    activation_dropout=0.0,
                    feat_proj_dropout=0.0,
                    final_dropout=0.0,
                    **small,
                )
            ),
            w2v,
            ("x",),
            "ce",
            logits,
        ),
        Entry(
            "DistilBertForSequenceClassification",
            "transformers",
            lambda: hf.DistilBertForSequenceClassification(
                hf.DistilBertConfig(
                    vocab_size=64,
                    max_position_embeddings=32,
                    dim=32,
                    n_layers=2,
                    n_heads=2,
                    hidden_dim=64,
                    dropout=0.0,
                    attention_dropout=0.0,
                    seq_classif_dropout=0.0,
                    num_labels=3,
                )
            ),
            _tokens(classes=3),
            ("x", "am"),
            "ce",
            logits,
        ),
        Entry(
            "LlamaForCausalLM (grouped-query attention, KV cache on by default)",
            "transformers",
            lambda: hf.LlamaForCausalLM(
                hf.LlamaConfig(
                    vocab_size=64, max_position_embeddings=32, num_key_value_heads=1, **small
                )
            ),
            _tokens(),
            ("x", "am"),
            "ce",
            logits,
            trainer=True,
        ),
        Entry(
            "MixtralForCausalLM (mixture of experts: grouped matmul)",
            "transformers",
            lambda: hf.MixtralForCausalLM(
                hf.MixtralConfig(
                    vocab_size=64,
                    max_position_embeddings=32,
                    num_key_value_heads=1,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                    **small,
                )
            ),
            _tokens(),
            ("x", "am"),
            "ce",
            logits,
        ),
        Entry(
            "MambaForCausalLM (selective state space, cache on by default)",
            "transformers",
            lambda: hf.MambaForCausalLM(
                hf.MambaConfig(
                    vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2
                )
            ),
            _tokens(),
            ("x",),
            "ce",
            logits,
        ),
    ]


def zoo() -> list[Entry]:
    """Every zoo entry, in table order."""
    from tests.zoo.models_more import zoo_more

    return [*_stock(), *_vision(), *_audio(), *_hf(), *zoo_more()]


def build(entry: Entry, steps: int = 3) -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    """The entry's module (seed 0) and ``steps`` batches (seed 1)."""
    torch.manual_seed(0)
    net = entry.build()
    if entry.eval_bn:
        eval_batchnorm(net)
    g = torch.Generator().manual_seed(1)
    return net, [entry.batch(g) for _ in range(steps)]

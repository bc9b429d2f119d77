"""The zoo's second set: more public architectures at tiny random-init configs (issue 39).

Same rules as ``tests/zoo/models.py``: no downloads (constructors and ``from_config`` only),
dropout and stochastic depth at 0, one seed. Each entry's batch is the smallest that shows
the architecture (32px images, 8 tokens) so a step costs milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from tests.zoo.models import B, Entry, Kw, _img, _rows, _tokens

logits = lambda o: o["logits"]  # noqa: E731
hidden = lambda o: o["last_hidden_state"]  # noqa: E731
first = lambda o: o[0]  # noqa: E731


# -- stock torch -------------------------------------------------------------------------
class PackedLSTM(nn.Module):
    """nn.LSTM over ``pack_padded_sequence`` (lengths from the batch, unsorted)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, n, batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        return self.head(h.sum(1))


class Generator(nn.Module):
    """A DCGAN-style generator: ConvTranspose2d upsampling with GroupNorm, tanh out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(16, 16, 4, 1, 0, bias=False),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.ConvTranspose2d(8, 3, 4, 2, 1),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class BagRNN(nn.Module):
    """nn.EmbeddingBag (mean over a bag per step) feeding an Elman nn.RNN."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(32, 8, mode="mean")
        self.rnn = nn.RNN(8, 16, batch_first=True, nonlinearity="tanh")
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, k = x.shape  # k ids per bag
        e = self.bag(x.reshape(b * t, k)).reshape(b, t, -1)
        return self.head(self.rnn(e)[0][:, -1])


def _stock() -> list[Entry]:
    def packed(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "x": torch.randn(B, 6, 8, generator=g),
            "n": torch.tensor([4, 6]),
            "y": torch.tensor([1, 3]),
        }

    def bags(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randint(0, 32, (B, 5, 3), generator=g), "y": torch.tensor([0, 2])}

    return [
        Entry("nn.LSTM over packed sequences", "torch", PackedLSTM, packed, ("x", "n")),
        Entry(
            "ConvTranspose2d generator (DCGAN-style, GroupNorm)",
            "torch",
            Generator,
            _rows(z=(B, 16, 1, 1)),
            ("z",),
            "l2",
        ),
        Entry("nn.EmbeddingBag (mean) + nn.RNN", "torch", BagRNN, bags, ("x",)),
    ]


# -- torchvision ---------------------------------------------------------------------------
def _vision() -> list[Entry]:
    import torchvision.models as tvm
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

    def swin(**kw: Any) -> nn.Module:
        return tvm.SwinTransformer(
            [4, 4], 16, [1, 1], [1, 2], [4, 4], stochastic_depth_prob=0.0, num_classes=10, **kw
        )

    entries = [
        Entry("swin_t-style (32px, window 4, 2 stages)", "torchvision", swin, _img(32), ("x",)),
        Entry(
            "swin_v2-style (PatchMergingV2, cosine attention)",
            "torchvision",
            lambda: swin(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2),
            _img(32),
            ("x",),
        ),
        Entry(
            "maxvit (32px, 2 stages, partition 2)",
            "torchvision",
            lambda: tvm.MaxVit((32, 32), 8, 2, [16, 32], [1, 1], 8, 0.0, num_classes=10),
            _img(32),
            ("x",),
        ),
    ]
    for e in entries:
        e.lr = 0.01
    return entries


# -- torchaudio ----------------------------------------------------------------------------
def _audio() -> list[Entry]:
    import torchaudio.models as tam

    def wavernn(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "w": torch.randn(B, 1, 16, generator=g),
            "s": torch.randn(B, 1, 8, 6, generator=g),
            "y": torch.randint(0, 16, (B, 16), generator=g),
        }

    def taco(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "t": torch.randint(1, 20, (B, 6), generator=g),
            "tn": torch.tensor([6, 5]),
            "m": torch.randn(B, 8, 5, generator=g),
            "mn": torch.tensor([5, 4]),
            "y": torch.zeros(B, dtype=torch.long),
        }

    def tacotron2() -> nn.Module:
        return tam.Tacotron2(
            n_mels=8,
            n_symbol=20,
            symbol_embedding_dim=16,
            encoder_embedding_dim=16,
            encoder_n_convolution=1,
            encoder_kernel_size=3,
            decoder_rnn_dim=16,
            decoder_dropout=0.0,
            attention_rnn_dim=16,
            attention_hidden_dim=8,
            attention_location_n_filter=4,
            attention_location_kernel_size=3,
            attention_dropout=0.0,
            prenet_dim=8,
            postnet_n_convolution=1,
            postnet_kernel_size=3,
            postnet_embedding_dim=8,
        )

    def wavlm() -> nn.Module:
        return tam.wavlm_model(
            "group_norm",
            [(16, 10, 5), (16, 3, 2)],
            False,
            32,
            0.0,
            16,
            4,
            2,
            2,
            32,
            64,
            0.0,
            64,
            0.0,
            0.0,
            False,
            0.0,
            10,
        )

    return [
        Entry(
            "WaveRNN",
            "torchaudio",
            lambda: tam.WaveRNN([2, 2], 16, 4, 1, 16, 16, 3, 8, 8, 8),
            wavernn,
            ("w", "s"),
        ),
        Entry(
            "Tacotron2 (prenet dropout always on)",
            "torchaudio",
            tacotron2,
            taco,
            ("t", "tn", "m", "mn"),
            "l2",
            first,
        ),
        Entry(
            "wavlm_model (gated relative position bias)",
            "torchaudio",
            wavlm,
            _rows(x=(B, 400)),
            ("x",),
            "l2",
            first,
        ),
    ]


# -- transformers --------------------------------------------------------------------------
def _hf() -> list[Entry]:
    import transformers as hf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    nodrop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    text = dict(vocab_size=64, max_position_embeddings=32)

    def cls(model: type, cfg: Any) -> Entry:
        return Entry(
            model.__name__,
            "transformers",
            lambda: model(cfg()),
            _tokens(classes=3),
            ("x", "am"),
            "ce",
            logits,
        )

    def lm(model: type, cfg: Any, note: str = "") -> Entry:
        name = f"{model.__name__} ({note})" if note else model.__name__
        return Entry(
            name,
            "transformers",
            lambda: Kw(model(cfg()), ("input_ids", "attention_mask"), use_cache=False),
            _tokens(),
            ("x", "am"),
            "ce",
            logits,
        )

    def seq2seq(g: torch.Generator) -> dict[str, torch.Tensor]:
        b = _tokens()(g)
        return {**b, "dx": b["y"]}

    def image(model: type, cfg: Any, note: str = "") -> Entry:
        name = f"{model.__name__} ({note})" if note else model.__name__
        return Entry(name, "transformers", lambda: model(cfg()), _img(32), ("x",), "ce", logits)

    def ast(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(B, 32, 16, generator=g), "y": torch.tensor([0, 2])}

    def patchtst(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(B, 32, 3, generator=g), "y": torch.zeros(B, dtype=torch.long)}

    bart = dict(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        **text,
    )
    decoder = dict(num_key_value_heads=1, **small, **text)
    return [
        cls(
            hf.RobertaForSequenceClassification,
            lambda: hf.RobertaConfig(num_labels=3, pad_token_id=0, **small, **nodrop, **text),
        ),
        cls(
            hf.AlbertForSequenceClassification,
            lambda: hf.AlbertConfig(
                embedding_size=16,
                num_labels=3,
                classifier_dropout_prob=0.0,
                **small,
                **nodrop,
                **text,
            ),
        ),
        cls(
            hf.ElectraForSequenceClassification,
            lambda: hf.ElectraConfig(embedding_size=16, num_labels=3, **small, **nodrop, **text),
        ),
        cls(
            hf.DebertaV2ForSequenceClassification,
            lambda: hf.DebertaV2Config(
                num_labels=3,
                relative_attention=True,
                position_buckets=8,
                pos_att_type=["p2c", "c2p"],
                pooler_dropout=0.0,
                **small,
                **nodrop,
                **text,
            ),
        ),
        Entry(
            "BartForConditionalGeneration",
            "transformers",
            lambda: Kw(
                hf.BartForConditionalGeneration(hf.BartConfig(**bart)),
                ("input_ids", "attention_mask", "decoder_input_ids"),
                use_cache=False,
            ),
            seq2seq,
            ("x", "am", "dx"),
            "ce",
            logits,
        ),
        Entry(
            "MarianMTModel",
            "transformers",
            lambda: Kw(
                hf.MarianMTModel(hf.MarianConfig(**bart)),
                ("input_ids", "attention_mask", "decoder_input_ids"),
                use_cache=False,
            ),
            seq2seq,
            ("x", "am", "dx"),
            "ce",
            logits,
        ),
        lm(
            hf.OPTForCausalLM,
            lambda: hf.OPTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=64,
                word_embed_proj_dim=32,
                dropout=0.0,
                attention_dropout=0.0,
                pad_token_id=0,
                **text,
            ),
        ),
        lm(
            hf.GPTNeoForCausalLM,
            lambda: hf.GPTNeoConfig(
                bos_token_id=1,
                eos_token_id=2,
                hidden_size=32,
                num_layers=2,
                num_heads=2,
                attention_types=[[["global", "local"], 1]],
                window_size=4,
                embed_dropout=0.0,
                attention_dropout=0.0,
                resid_dropout=0.0,
                **text,
            ),
            "global + local attention",
        ),
        lm(
            hf.FalconForCausalLM,
            lambda: hf.FalconConfig(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            ),
            "multi-query, parallel attention",
        ),
        lm(hf.Qwen2ForCausalLM, lambda: hf.Qwen2Config(**decoder)),
        lm(
            hf.PhiForCausalLM,
            lambda: hf.PhiConfig(
                partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, **decoder
            ),
            "partial rotary",
        ),
        lm(
            hf.MistralForCausalLM,
            lambda: hf.MistralConfig(sliding_window=4, **decoder),
            "sliding window 4",
        ),
        lm(hf.GemmaForCausalLM, lambda: hf.GemmaConfig(head_dim=16, **decoder)),
        Entry(
            "CLIPTextModel",
            "transformers",
            lambda: hf.CLIPTextModel(
                hf.CLIPTextConfig(
                    bos_token_id=1,
                    eos_token_id=2,
                    pad_token_id=0,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    projection_dim=16,
                    **text,
                )
            ),
            _tokens(),
            ("x", "am"),
            "l2",
            hidden,
        ),
        Entry(
            "CLIPVisionModel",
            "transformers",
            lambda: hf.CLIPVisionModel(hf.CLIPVisionConfig(image_size=32, patch_size=8, **small)),
            _img(32),
            ("x",),
            "l2",
            hidden,
        ),
        image(
            hf.SwinForImageClassification,
            lambda: hf.SwinConfig(
                image_size=32,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[1, 2],
                window_size=4,
                drop_path_rate=0.0,
                num_labels=10,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
        ),
        image(
            hf.ConvNextForImageClassification,
            lambda: hf.ConvNextConfig(
                num_stages=2,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                num_labels=10,
                drop_path_rate=0.0,
            ),
        ),
        image(
            hf.ResNetForImageClassification,
            lambda: hf.ResNetConfig(
                embedding_size=16,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="basic",
                num_labels=10,
            ),
            "BatchNorm in train mode",
        ),
        Entry(
            "SegformerForSemanticSegmentation",
            "transformers",
            lambda: hf.SegformerForSemanticSegmentation(
                hf.SegformerConfig(
                    num_encoder_blocks=2,
                    depths=[1, 1],
                    sr_ratios=[2, 1],
                    hidden_sizes=[16, 32],
                    num_attention_heads=[1, 2],
                    patch_sizes=[7, 3],
                    strides=[4, 2],
                    decoder_hidden_size=32,
                    num_labels=5,
                    drop_path_rate=0.0,
                    **nodrop,
                    classifier_dropout_prob=0.0,
                )
            ),
            _img(32),
            ("x",),
            "l2",
            logits,
        ),
        Entry(
            "HubertModel",
            "transformers",
            lambda: hf.HubertModel(
                hf.HubertConfig(
                    conv_dim=(16, 16),
                    conv_stride=(5, 2),
                    conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16,
                    num_conv_pos_embedding_groups=4,
                    layerdrop=0.0,
                    mask_time_prob=0.0,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    activation_dropout=0.0,
                    feat_proj_dropout=0.0,
                    **small,
                )
            ),
            _rows(x=(B, 400)),
            ("x",),
            "l2",
            hidden,
        ),
        Entry(
            "ASTForAudioClassification",
            "transformers",
            lambda: hf.ASTForAudioClassification(
                hf.ASTConfig(
                    max_length=32,
                    num_mel_bins=16,
                    patch_size=8,
                    frequency_stride=8,
                    time_stride=8,
                    num_labels=3,
                    **small,
                    **nodrop,
                )
            ),
            ast,
            ("x",),
            "ce",
            logits,
        ),
        Entry(
            "PatchTSTModel (time series)",
            "transformers",
            lambda: Kw(
                hf.PatchTSTModel(
                    hf.PatchTSTConfig(
                        num_input_channels=3,
                        context_length=32,
                        patch_length=8,
                        patch_stride=8,
                        d_model=16,
                        num_hidden_layers=1,
                        num_attention_heads=2,
                        ffn_dim=32,
                        dropout=0.0,
                        attention_dropout=0.0,
                        ff_dropout=0.0,
                        positional_dropout=0.0,
                        path_dropout=0.0,
                        head_dropout=0.0,
                        norm_type="layernorm",
                        do_mask_input=False,
                    )
                ),
                ("past_values",),
            ),
            patchtst,
            ("x",),
            "l2",
            hidden,
        ),
        Entry(
            "DetrForObjectDetection (resnet backbone, no timm)",
            "transformers",
            lambda: hf.DetrForObjectDetection(
                hf.DetrConfig(
                    use_timm_backbone=False,
                    use_pretrained_backbone=False,
                    backbone_config=hf.ResNetConfig(
                        embedding_size=8,
                        hidden_sizes=[8, 16],
                        depths=[1, 1],
                        out_features=["stage2"],
                    ),
                    d_model=16,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                    encoder_ffn_dim=32,
                    decoder_ffn_dim=32,
                    num_queries=4,
                    num_labels=3,
                    dropout=0.0,
                    attention_dropout=0.0,
                )
            ),
            _img(32),
            ("x",),
            "l2",
            logits,
        ),
    ]


def zoo_more() -> list[Entry]:
    """The second set's entries, in table order."""
    return [*_stock(), *_vision(), *_audio(), *_hf()]

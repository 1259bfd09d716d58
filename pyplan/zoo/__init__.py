"""The model zoo: reference architectures in plain torch, by name, with their published parameter counts.

Image models come at the four resolutions of Jansen's thesis (Table 3.2, Appendix A): ImageNet (no suffix,
3x224x224, 1000 classes, torchvision's networks), `-highres` (3x512x512, the same networks), `-cifar10`
(3x32x32, 10 classes, kuangliu/pytorch-cifar's networks, the thesis's ref. 43) and `-mnist` (1x28x28, 10
classes, the CIFAR-10 networks with a one-channel stem; no count is published for these).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from pyplan.errors import ModelLoadError
from pyplan.spec import Inputs, ModelSpec, cross_entropy
from pyplan.zoo import small
from pyplan.zoo.amoeba import AMOEBANET_CONFIGS, AmoebaNet
from pyplan.zoo.mobilenet import MobileNetV2
from pyplan.zoo.resnet import resnet
from pyplan.zoo.transformer import BERT_CONFIGS, GPT, GPT2_CONFIGS, LLAMA_CONFIGS, Bert, Llama
from pyplan.zoo.vgg import CONFIGS, VGG

__all__ = ["get", "names"]

_SEED = 0


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(_SEED)


def _images(b: int, *, channels: int, size: int) -> Inputs:
    return (torch.randn(b, channels, size, size, generator=_generator()),)


def _features(b: int, *, n: int) -> Inputs:
    return (torch.randn(b, n, generator=_generator()),)


def _labels(b: int, *, classes: int) -> torch.Tensor:
    return torch.randint(classes, (b,), generator=_generator())


def _token_stream(b: int, vocab: int, seq_len: int) -> torch.Tensor:
    """seq_len + 1 tokens per sample, so inputs and next-token targets come from one draw."""
    return torch.randint(vocab, (b, seq_len + 1), generator=_generator())


def _tokens(b: int, *, vocab: int, seq_len: int) -> Inputs:
    return (_token_stream(b, vocab, seq_len)[:, :-1].contiguous(),)


def _next_tokens(b: int, *, vocab: int, seq_len: int) -> torch.Tensor:
    return _token_stream(b, vocab, seq_len)[:, 1:].contiguous()


def _tokens_and_mask(b: int, *, vocab: int, seq_len: int) -> Inputs:
    """Token ids and an int64 attention mask that pads each sample after a random length in [T/2, T]."""
    g = _generator()
    ids = torch.randint(vocab, (b, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (b,), generator=g)
    return ids, (torch.arange(seq_len)[None, :] < lengths[:, None]).long()


def _classifier(
    name: str, build: Callable[[], nn.Module], dataset: str, published: int | None, source: str
) -> ModelSpec:
    channels, size, classes = _DATASETS[dataset]
    return ModelSpec(
        name=name,
        build=build,
        example_inputs=partial(_images, channels=channels, size=size),
        loss=F.cross_entropy,
        target=partial(_labels, classes=classes),
        published_params=published,
        source=source,
    )


def _language_model(
    name: str, build: Callable[[], nn.Module], *, vocab: int, seq_len: int, published: int, source: str
) -> ModelSpec:
    return ModelSpec(
        name=name,
        build=build,
        example_inputs=partial(_tokens, vocab=vocab, seq_len=seq_len),
        loss=cross_entropy,
        target=partial(_next_tokens, vocab=vocab, seq_len=seq_len),
        published_params=published,
        source=source,
    )


# Dataset -> (input channels, image size, classes).
_DATASETS: dict[str, tuple[int, int, int]] = {
    "imagenet": (3, 224, 1000),
    "highres": (3, 512, 1000),
    "cifar10": (3, 32, 10),
    "mnist": (1, 28, 10),
}

_RESNET_COUNTS: dict[int, tuple[int, int]] = {
    # depth: (torchvision.models.resnetN, 1000 classes; kuangliu ResNetN, 10 classes)
    18: (11_689_512, 11_173_962),
    34: (21_797_672, 21_282_122),
    50: (25_557_032, 23_520_842),
    101: (44_549_160, 42_512_970),
    152: (60_192_808, 58_156_618),
}

_VGG_COUNTS: dict[str, tuple[int, int, int]] = {
    # name: (torchvision vggN; torchvision vggN_bn; kuangliu VGG('VGGN'), with BatchNorm, 10 classes)
    "vgg11": (132_863_336, 132_868_840, 9_231_114),
    "vgg16": (138_357_544, 138_365_992, 14_728_266),
}

_MNIST = "no published count: the CIFAR-10 model with a 1-channel stem (Jansen, Appendix A.1)"


def _image_specs() -> list[ModelSpec]:
    specs: list[ModelSpec] = []
    for depth, (imagenet, cifar) in _RESNET_COUNTS.items():
        name, tv = f"resnet{depth}", f"torchvision.models.resnet{depth} (1000 classes)"
        small_input = partial(resnet, depth, num_classes=10, small_input=True)
        specs += [
            _classifier(name, partial(resnet, depth), "imagenet", imagenet, tv),
            _classifier(f"{name}-highres", partial(resnet, depth), "highres", imagenet, tv),
            _classifier(
                f"{name}-cifar10",
                small_input,
                "cifar10",
                cifar,
                f"kuangliu/pytorch-cifar ResNet{depth} (10 classes)",
            ),
            _classifier(f"{name}-mnist", partial(small_input, in_channels=1), "mnist", None, _MNIST),
        ]

    cifar_vgg = partial(VGG, batch_norm=True, num_classes=10, pool_size=1, hidden=())
    for name, (imagenet, imagenet_bn, cifar) in _VGG_COUNTS.items():
        layers, tv = CONFIGS[name], f"torchvision.models.{name} (1000 classes)"
        specs += [
            _classifier(name, partial(VGG, layers), "imagenet", imagenet, tv),
            _classifier(
                f"{name}-bn",
                partial(VGG, layers, batch_norm=True),
                "imagenet",
                imagenet_bn,
                f"torchvision.models.{name}_bn (1000 classes)",
            ),
            _classifier(f"{name}-highres", partial(VGG, layers), "highres", imagenet, tv),
            _classifier(
                f"{name}-cifar10",
                partial(cifar_vgg, layers),
                "cifar10",
                cifar,
                f"kuangliu/pytorch-cifar VGG('{name.upper()}') (10 classes)",
            ),
            # 28x28 halves to 1x1 after four pools, and a fifth pool of a 1x1 map is empty: it is left out.
            _classifier(f"{name}-mnist", partial(cifar_vgg, layers[:-1], in_channels=1), "mnist", None, _MNIST),
        ]

    tv = "torchvision.models.mobilenet_v2 (1000 classes)"
    cifar_mobilenet = partial(MobileNetV2, num_classes=10, cifar=True)
    specs += [
        _classifier("mobilenet-v2", MobileNetV2, "imagenet", 3_504_872, tv),
        _classifier("mobilenet-v2-highres", MobileNetV2, "highres", 3_504_872, tv),
        _classifier(
            "mobilenet-v2-cifar10",
            cifar_mobilenet,
            "cifar10",
            2_296_922,
            "kuangliu/pytorch-cifar MobileNetV2 (10 classes)",
        ),
        _classifier("mobilenet-v2-mnist", partial(cifar_mobilenet, in_channels=1), "mnist", None, _MNIST),
    ]
    return specs


def _amoebanet_specs() -> list[ModelSpec]:
    # No published count fits this genotype: GPipe's (Huang et al. 2019, Table 1) are for its own AmoebaNet-D cells.
    counts = {"amoebanet-d-18": (186_172_492, "82M"), "amoebanet-d-36": (2_374_041_616, "1.05B")}
    specs = []
    for name, cfg in AMOEBANET_CONFIGS.items():
        n, d = cfg.num_layers // 3, cfg.filters
        count, gpipe = counts[name]
        source = (
            f"AmoebaNet-D-like (genotype of pyplan.zoo.amoeba) at GPipe's (L, D) = ({cfg.num_layers}, {d}): stem, "
            f"2 stem reduction cells ({d // 4}, {d // 2} channels), 3 stacks of {n} normal cells ({d}, {2 * d}, "
            f"{4 * d} channels) with 2 reduction cells between, 224x224, 1000 classes: {count:,} parameters "
            f"(GPipe reports {gpipe} for its own cells)"
        )
        specs.append(_classifier(name, partial(AmoebaNet, cfg), "imagenet", None, source))
    return specs


def _transformer_specs() -> list[ModelSpec]:
    published_gpt2 = {
        "gpt2-small": 124_439_808,
        "gpt2-medium": 354_823_168,
        "gpt2-large": 774_030_080,
        "gpt2-xl": 1_557_611_200,
    }
    specs = [
        _language_model(
            name,
            partial(GPT, cfg),
            vocab=cfg.vocab_size,
            seq_len=cfg.n_ctx,
            published=published_gpt2[name],
            source=f"HF {name.replace('-small', '')} (GPT-2 paper, Table 2), lm_head tied to wte",
        )
        for name, cfg in GPT2_CONFIGS.items()
    ]

    published_bert = {
        "bert-base": (109_482_240, "HF bert-base-uncased BertModel with pooler (BERT paper: 110M)"),
        "bert-large": (335_141_888, "HF bert-large-uncased BertModel with pooler (BERT paper: 340M)"),
    }
    for name, bert in BERT_CONFIGS.items():
        published, source = published_bert[name]
        # BertModel has no task head: the pooled output is the model's output, and the loss and target are
        # ModelSpec's defaults (mean squared error against zeros).
        specs.append(
            ModelSpec(
                name=name,
                build=partial(Bert, bert),
                example_inputs=partial(_tokens_and_mask, vocab=bert.vocab_size, seq_len=bert.max_position_embeddings),
                published_params=published,
                source=source,
            )
        )

    published_llama = {
        "llama-1b-style": (1_235_814_400, "HF meta-llama/Llama-3.2-1B, tied embeddings, 8 KV heads"),
        "llama-7b-style": (6_738_415_616, "LLaMA-1 7B (and Llama-2-7B), HF count, untied output head"),
        "llama-13b-style": (13_015_864_320, "Llama-2-13B, HF count, untied output head"),
        "llama-70b-style": (68_976_648_192, "Llama-2-70B, HF count, 8 KV heads, untied output head"),
    }
    for name, llama in LLAMA_CONFIGS.items():
        published, source = published_llama[name]
        specs.append(
            _language_model(
                name,
                partial(Llama, llama),
                vocab=llama.vocab_size,
                seq_len=llama.max_seq_len,
                published=published,
                source=source,
            )
        )
    return specs


def _small_specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            name="mlp-tiny",
            build=small.mlp_tiny,
            example_inputs=partial(_features, n=small.MLP_FEATURES),
            loss=F.cross_entropy,
            target=partial(_labels, classes=small.MLP_CLASSES),
            published_params=6_922,
            source="hand count: (32*64+64) + (64*64+64) + (64*10+10)",
        ),
        ModelSpec(
            name="grouped-mlp-tiny",
            build=small.grouped_mlp_tiny,
            example_inputs=partial(_features, n=small.MLP_FEATURES),
            loss=F.cross_entropy,
            target=partial(_labels, classes=small.MLP_CLASSES),
            published_params=9_866,
            source="hand count: stem (32*128+128) + 8 branches x 2 x (16*16+16) + head (128*10+10)",
        ),
        _classifier(
            "resnet-tiny",
            small.resnet_tiny,
            "cifar10",
            56_538,
            "hand count: stem 464 + blocks 4,672 + 14,528 + 36,384 + fc 490",
        ),
        _classifier(
            "vgg-tiny",
            small.vgg_tiny,
            "cifar10",
            32_138,
            "hand count: convs 448 + 4,640 + 18,496 + classifier 8,224 + 330",
        ),
        _language_model(
            "gpt-tiny",
            small.gpt_tiny,
            vocab=small.GPT_TINY.vocab_size,
            seq_len=small.GPT_TINY.n_ctx,
            published=118_528,
            source="hand count: wte 16,384 + wpe 2,048 + 2 x 49,984 + ln_f 128, lm_head tied",
        ),
    ]


_ZOO: dict[str, ModelSpec] = {
    s.name: s for s in [*_image_specs(), *_amoebanet_specs(), *_transformer_specs(), *_small_specs()]
}


def names() -> list[str]:
    """Every zoo model name, sorted."""
    return sorted(_ZOO)


def get(name: str) -> ModelSpec:
    """The zoo model `name`; an unknown name raises ModelLoadError suggesting the closest known names."""
    spec = _ZOO.get(name)
    if spec is not None:
        return spec
    close = difflib.get_close_matches(name, _ZOO, n=3)
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    raise ModelLoadError(f"unknown zoo model '{name}'{hint} (pyplan zoo list shows all)")

"""`plait.models.vgg`: the CIFAR VGG's size, small images, bad configs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.models.vgg import VGG


def test_vgg16_has_the_cifar_parameter_count() -> None:
    # 13 conv+BN layers and one 512->10 linear: 14,728,266 parameters as published for
    # the CIFAR VGG-16 with batch norm
    assert sum(p.numel() for p in VGG(config="vgg16").parameters()) == 14_728_266


def test_small_images_skip_pools_that_would_empty_them() -> None:
    model = VGG(config="vgg11", in_channels=1, num_classes=4, image_size=8).eval()
    pools = sum(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert pools == 3  # 8 -> 4 -> 2 -> 1; the last two pools are skipped
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 4)


def test_unknown_config() -> None:
    with pytest.raises(ValueError, match="unknown VGG config 'vgg99'"):
        VGG(config="vgg99")

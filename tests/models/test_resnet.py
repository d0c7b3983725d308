"""`plait.models.resnet`: the CIFAR ResNet-18's shapes and its published size."""

from __future__ import annotations

import torch

from plait.models.resnet import BasicBlock, ResNet18


def test_standard_width_has_the_cifar_resnet18_parameter_count() -> None:
    # 11,173,962: the CIFAR ResNet-18 (3x3 stem, no max-pool, 10 classes) as published
    model = ResNet18()
    assert sum(p.numel() for p in model.parameters()) == 11_173_962


def test_forward_shapes_for_digits_and_cifar_sizes() -> None:
    model = ResNet18(in_channels=1, num_classes=7, width=4).eval()
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 7)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_basic_block_projects_only_when_shapes_change() -> None:
    assert isinstance(BasicBlock(8, 8).shortcut, torch.nn.Identity)
    block = BasicBlock(8, 16, stride=2)
    assert not isinstance(block.shortcut, torch.nn.Identity)
    assert block(torch.randn(1, 8, 8, 8)).shape == (1, 16, 4, 4)

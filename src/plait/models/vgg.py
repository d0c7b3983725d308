"""VGG in its CIFAR form: 3x3 conv stacks with batch norm and one linear classifier.

VGG concentrates its parameters in wide late convolutions, a different gradient-size
profile from ResNet (few, large tensors), which is why the compression papers report it.
"""

from __future__ import annotations

import torch
from torch import nn

#: Channel plans; "M" is a 2x2 max-pool.
CONFIGS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ],
}


class VGG(nn.Module):
    """VGG with batch norm.

    Args:
        config: a key of `CONFIGS`.
        in_channels: image channels.
        num_classes: output logits.
        image_size: input height/width; pools that would shrink it below 1 are skipped.
    """

    def __init__(
        self,
        *,
        config: str = "vgg16",
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 32,
    ) -> None:
        super().__init__()
        if config not in CONFIGS:
            raise ValueError(f"unknown VGG config {config!r}; choose from {sorted(CONFIGS)}")
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for item in CONFIGS[config]:
            if item == "M":
                if size >= 2:
                    layers.append(nn.MaxPool2d(2))
                    size //= 2
                continue
            assert isinstance(item, int)
            layers += [nn.Conv2d(channels, item, 3, padding=1), nn.BatchNorm2d(item), nn.ReLU()]
            channels = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))  # type: ignore[no-any-return]

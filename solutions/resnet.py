"""A ResNet written out: the image classifier of lesson 08, for where torchvision cannot load.

torchvision's ResNets are what clusters use (``--model torchvision-resnet18``); its wheels on the
package registry are built against CUDA torch, though, and do not import with a CPU build of torch
(``operator torchvision::nms does not exist``). This is ResNet-18's layout (He et al., 2016): a
stem, four stages of two residual blocks, each stage halving the image and doubling the channels,
then average pooling and one linear layer. ``width`` scales every stage's channels (64 is
ResNet-18's); small images (CIFAR-sized) get a 3x3 stem that keeps their resolution, large ones
ImageNet's 7x7 stem with stride 2 and max pooling.
"""
import torch.nn as nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut: out = relu(x' + F(x)), x' the input, or a 1x1
    convolution of it where the block changes the resolution or the channels."""

    def __init__(self, channels_in, channels_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_classes, width=64, blocks=(2, 2, 2, 2), small_images=True):
        super().__init__()
        if small_images:  # 32 x 32: keep the resolution for the stages
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        else:  # ImageNet-sized: a quarter of the resolution before the stages
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
        stages, channels = [], width
        for n, count in enumerate(blocks):
            out = width * 2**n
            stages += [BasicBlock(channels, out, stride=1 if n == 0 else 2)]
            stages += [BasicBlock(out, out, stride=1) for _ in range(count - 1)]
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))
        for module in self.modules():  # He initialisation, as torchvision's ResNets
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))

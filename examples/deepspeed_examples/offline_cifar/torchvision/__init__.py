"""A stand-in for the slice of ``torchvision`` DeepSpeedExamples' CIFAR script uses, for machines where
torchvision cannot be installed (its PyPI wheels are built against CUDA torch) and CIFAR-10 cannot be
downloaded: ``datasets.CIFAR10`` yields synthetic labelled images (class-dependent means, so a model can learn),
``transforms`` does what the script asks (ToTensor, Normalize, Compose). Not part of zerospeed."""

from . import datasets, transforms

__version__ = "0.0-offline"
__all__ = ["datasets", "transforms"]

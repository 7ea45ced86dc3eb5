"""A model trained by dtrain, evaluated in PyTorch: the trainer's MLP (tools/trainer/models.h) built in
Python, its weights from a dtrain checkpoint opened with torch.load(weights_only=True), its accuracy on
Fashion-MNIST's test split computed as the trainer computes it (pixels / 255 normalized by the dataset's
mean 0.2860 and std 0.3530; the top logit against the label).

    evaluate_trainer_checkpoint.py CHECKPOINT FASHION_MNIST_DIR

Prints "accuracy A" (the fraction correct of the 10000 test images).
"""

import gzip
import os
import sys

import numpy
import torch


def idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return numpy.frombuffer(data, dtype=numpy.uint8, offset=4 + 4 * dims).reshape(shape)


def find(folder, name):
    for candidate in (os.path.join(folder, name), os.path.join(folder, name + ".gz")):
        if os.path.exists(candidate):
            return candidate
    sys.exit(f"{name}(.gz) is not in {folder}")


def main():
    checkpoint, folder = sys.argv[1], sys.argv[2]
    state = torch.load(checkpoint, weights_only=True)
    net = torch.nn.Sequential()
    net.add_module("flatten", torch.nn.Flatten())
    net.add_module("fc1", torch.nn.Linear(784, 256))
    net.add_module("relu1", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(256, 128))
    net.add_module("relu2", torch.nn.ReLU())
    net.add_module("fc3", torch.nn.Linear(128, 10))
    net.load_state_dict(state["model"])  # strict: fc1.weight, ..., fc3.bias and nothing else
    images = torch.from_numpy(idx(find(folder, "t10k-images-idx3-ubyte")).copy()).float()
    images = images.sub_(255.0 * 0.2860).div_(255.0 * 0.3530).unsqueeze(1)
    labels = torch.from_numpy(idx(find(folder, "t10k-labels-idx1-ubyte")).astype(numpy.int64))
    with torch.no_grad():
        correct = (net(images).argmax(1) == labels).sum().item()
    print(f"accuracy {correct / labels.numel():.6g}")


if __name__ == "__main__":
    main()

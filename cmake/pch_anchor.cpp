// Anchor translation unit for the precompiled <torch/torch.h> (cmake/torch_targets.cmake).

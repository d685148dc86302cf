"""Forward + backward of ``SphereConv2d`` at a CIFAR layer size (B=32, 64 -> 64 channels, 32x32, 3x3).

Timed in the same run: ``nn.Conv2d`` of the same shape (the baseline), each SphereConv angular
function, and the ``unfold`` formulation of public ports (patches materialised as a
Tensor[B, C*9, H*W], norms taken along it).  Goal: cosine SphereConv2d at most 1.5x Conv2d.
"""

import torch
import torch.nn.functional as F

from sphereml.sphereconv import SphereConv2d, angular_activation

from .harness import compare

B, C, H, K = 32, 64, 32, 3


def unfold_sphere_conv(x: torch.Tensor, weight: torch.Tensor, angular: str = "cosine") -> torch.Tensor:
    """The port-style formulation: unfold, normalise the patches and kernels, matmul, fold back."""
    patches = F.unfold(x, K, padding=1)  # (B, C*9, H*W)
    patches = patches / patches.norm(dim=1, keepdim=True).clamp_min(1e-6)
    w = weight.flatten(1)
    w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-6)
    cos = (w @ patches).clamp(-1, 1)  # (B, C_out, H*W)
    return angular_activation(cos, angular).view(x.shape[0], -1, H, H)


def run(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, C, H, H, generator=g).to(device).requires_grad_(True)
    target = torch.randn(B, C, H, H, generator=g).to(device)
    conv = torch.nn.Conv2d(C, C, K, padding=1, bias=False).to(device)
    layers = {f"SphereConv2d {a}": SphereConv2d(C, C, K, padding=1, angular=a, k=0.3).to(device)
              for a in ("cosine", "linear", "sigmoid")}
    layers["SphereConv2d sigmoid learned k"] = SphereConv2d(C, C, K, padding=1, angular="sigmoid",
                                                            learnable_k=True).to(device)

    def step(forward):
        x.grad = None
        (forward() * target).sum().backward()

    candidates = {"nn.Conv2d": lambda: step(lambda: conv(x))}
    for label, layer in layers.items():
        candidates[label] = lambda m=layer: step(lambda: m(x))
    candidates["unfold cosine (port style)"] = lambda: step(lambda: unfold_sphere_conv(x, conv.weight))
    return compare("sphereconv_fwd_bwd", candidates, baseline="nn.Conv2d", device=device, repeats=30,
                   extra={"batch": B, "channels": C, "size": H, "kernel": K})

"""Convolutional-similarity loss: power-spectrum (fft) form against the direct kernel-correlation form.

The direct form convolves every kernel channel with every other one: (S C)^2 (2N - 1)^2
outputs, which for a 512 x 512 x 3 x 3 layer is 1.7e12 values — hours on two CPU cores.
It is therefore timed on the first ``SUBSET`` kernels of the layer (all input channels) and
scaled by the number of kernel pairs, S (S - 1) / (S' (S' - 1)); the JSON says so.  The fft
form is timed on the whole layer, forward and backward, in the same run.

Also timed: forward + backward of the summed loss over every conv layer of ResNet-18 (the
paper reports about 90 s per convolutional-similarity step for ResNet-18 on an A5000 GPU).
"""

import torch

from sphereml.regularizers.convsim import conv_similarity
from sphereml.timing import median_seconds

from .harness import save, smoke_or

SUBSET = 24

# every conv of ResNet-18 (ImageNet stem), as (out, in, k)
RESNET18 = ([(64, 3, 7)] + [(64, 64, 3)] * 4
            + [(128, 64, 3), (128, 128, 3), (128, 64, 1), (128, 128, 3), (128, 128, 3)]
            + [(256, 128, 3), (256, 256, 3), (256, 128, 1), (256, 256, 3), (256, 256, 3)]
            + [(512, 256, 3), (512, 512, 3), (512, 256, 1), (512, 512, 3), (512, 512, 3)])


def _fwd_bwd(weight: torch.Tensor, method: str) -> None:
    weight.grad = None
    conv_similarity(weight, method=method).backward()


def run(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    result = {"benchmark": "convsim_fft_vs_direct",
              "direct_subset_kernels": SUBSET, "layers": {}}
    for channels in smoke_or((256, 512), (SUBSET + 2,)):
        weight = torch.randn(channels, channels, 3, 3, generator=g).to(device).requires_grad_(True)
        subset = weight.detach()[:SUBSET].clone().requires_grad_(True)
        fft_s = median_seconds(lambda w=weight: _fwd_bwd(w, "fft"), device, repeats=smoke_or(5, 1))
        direct_subset_s = median_seconds(lambda w=subset: _fwd_bwd(w, "direct"), device, repeats=1, warmup=0)
        pairs_ratio = channels * (channels - 1) / (SUBSET * (SUBSET - 1))
        direct_s = direct_subset_s * pairs_ratio
        with torch.no_grad():
            agree = float((conv_similarity(subset, method="fft") / conv_similarity(subset, method="direct") - 1).abs())
        result["layers"][f"{channels}x{channels}x3x3"] = {
            "fft_seconds": fft_s, "direct_seconds_on_subset": direct_subset_s,
            "direct_seconds_extrapolated": direct_s, "fft_speedup_vs_direct": direct_s / fft_s,
            "relative_difference_on_subset": agree,
        }
        print(f"convsim {channels}x{channels}x3x3: fft {fft_s * 1e3:8.1f} ms; direct {direct_subset_s:6.2f} s on "
              f"{SUBSET} kernels -> {direct_s:9.0f} s for the layer (extrapolated); "
              f"fft x{direct_s / fft_s:,.0f} faster")
    layers = smoke_or(RESNET18, RESNET18[:2])
    weights = [torch.randn(o, i, k, k, generator=g).to(device).requires_grad_(True) for o, i, k in layers]

    def resnet_step():
        for w in weights:
            w.grad = None
        sum(conv_similarity(w, method="fft") for w in weights).backward()

    resnet_s = median_seconds(resnet_step, device, repeats=smoke_or(5, 1))
    result["resnet18_all_conv_layers_fwd_bwd_seconds"] = resnet_s
    result["paper_resnet18_seconds_per_step"] = 90.0
    print(f"convsim ResNet-18, all {len(weights)} conv layers, forward+backward: {resnet_s * 1e3:.1f} ms "
          f"(paper: about 90 s per step on an A5000)")
    save(result, "convsim_fft_vs_direct", device)
    return result

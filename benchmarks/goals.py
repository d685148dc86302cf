"""The open issues' speed goals against the last saved results: ``python -m benchmarks.goals [cuda|cpu]``.

Each goal names a result file (``benchmarks/results/<stem>-<device>.json``), a candidate in it and the largest
ratio to that file's baseline that meets the goal, as the issue states it (issue 27: regularised training steps;
issue 29: the fused layers, heads and energy).  The report reads only the saved files: it says "not measured"
where a file or candidate is absent and "failed" where the run recorded an error, and never computes a figure
of its own.  ``benchmarks/gpu_check.sh bench`` prints it after the benchmarks, and the book's benchmark report
shows it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Goal", "GOALS", "status", "energy_status", "report"]

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Goal:
    """``candidate`` of ``<stem>-<device>.json`` within ``limit`` times that file's baseline (issue ``issue``)."""

    issue: int
    what: str  # the setting, as a reader would name it
    stem: str
    candidate: str
    limit: float


_CONV_B32, _CONV_B128 = "B=32, 64 ch, 32x32", "B=128, 128 ch, 32x32"
GOALS = (
    Goal(29, f"SphereConv cosine, {_CONV_B32}", "sphereconv_fwd_bwd", "SphereConv2d cosine", 1.25),
    Goal(29, f"SphereConv cosine, {_CONV_B128}", "sphereconv_fwd_bwd_b128_c128_s32", "SphereConv2d cosine", 1.25),
    Goal(29, f"SphereConv cosine, {_CONV_B128}, bf16", "sphereconv_fwd_bwd_b128_c128_s32_bf16", "SphereConv2d cosine",
         1.25),
    Goal(29, f"SphereConv learned k, {_CONV_B128}", "sphereconv_fwd_bwd_b128_c128_s32",
         "SphereConv2d sigmoid learned k", 1.4),
    Goal(29, f"SCS fixed p, q, {_CONV_B32}", "scs_fwd_bwd", "SCS fixed p, q", 1.25),
    Goal(29, f"SCS fixed p, q, {_CONV_B128}", "scs_fwd_bwd_b128_c128_s32", "SCS fixed p, q", 1.25),
    Goal(29, f"SCS learned p, q, {_CONV_B128}", "scs_fwd_bwd_b128_c128_s32", "SCS learned p, q", 1.4),
    Goal(29, f"TanhConv x cosine, {_CONV_B32}", "decoupled_fwd_bwd", "TanhConv cosine, rho E{||x||}", 1.4),
    Goal(29, f"TanhConv x cosine, {_CONV_B128}", "decoupled_fwd_bwd_b128_c128_s32", "TanhConv cosine, rho E{||x||}",
         1.4),
    *(Goal(29, f"SphereConv cosine fused, {where}", stem, "SphereConv2d cosine (fused epilogue)", 1.25)
      for where, stem in ((_CONV_B32, "sphereconv_fwd_bwd"), (_CONV_B128, "sphereconv_fwd_bwd_b128_c128_s32"),
                          (f"{_CONV_B128}, bf16", "sphereconv_fwd_bwd_b128_c128_s32_bf16"))),
    Goal(29, f"SphereConv cosine fused, channels-last, {_CONV_B128}, bf16", "sphereconv_fwd_bwd_b128_c128_s32_bf16",
         "SphereConv2d cosine (fused epilogue, channels-last)", 1.25),
    *(Goal(29, f"SCS fixed p, q fused, {where}", stem, "SCS fixed p, q (fused epilogue)", 1.25)
      for where, stem in ((_CONV_B32, "scs_fwd_bwd"), (_CONV_B128, "scs_fwd_bwd_b128_c128_s32"))),
    *(Goal(29, f"SCS learned p, q fused, {where}", stem, "SCS learned p, q (fused epilogue)", 1.4)
      for where, stem in ((_CONV_B32, "scs_fwd_bwd"), (_CONV_B128, "scs_fwd_bwd_b128_c128_s32"))),
    *(Goal(29, f"TanhConv x cosine fused, learned rho, {where}", stem, "TanhConv cosine, learned rho (fused epilogue)",
           1.4) for where, stem in ((_CONV_B32, "decoupled_fwd_bwd"), (_CONV_B128, "decoupled_fwd_bwd_b128_c128_s32"))),
    *(Goal(29, f"{head}, B=512, C=100,000", "margin_heads_fwd_bwd_b512_c100000", head, 1.1)
      for head in ("A-Softmax m=4 (annealed)", "L-Softmax m=4", "CosFace", "ArcFace")),
    *(Goal(29, f"{head}, B=256, C=10,000", "margin_heads_fwd_bwd", head, 1.5)
      for head in ("A-Softmax m=4 (annealed)", "L-Softmax m=4", "CosFace", "ArcFace")),
    *(Goal(29, f"{head} fused, B=512, C=100,000", "margin_heads_fwd_bwd_b512_c100000", f"{head} (fused)", 1.1)
      for head in ("A-Softmax m=4 (annealed)", "L-Softmax m=4", "CosFace", "ArcFace")),
    *(Goal(29, f"{head} fused, B=256, C=10,000", "margin_heads_fwd_bwd", f"{head} (fused)", 1.5)
      for head in ("A-Softmax m=4 (annealed)", "L-Softmax m=4", "CosFace", "ArcFace")),
    *(Goal(27, f"CNN-9 step with {reg}", "comhe_train_step_cnn9_b128", reg, 1.1)
      for reg in ("HS-MHE", "RP-CoMHE", "RP-CoMHE (max)", "AP-CoMHE (unrolled)", "G-CoMHE")),
    Goal(27, "CNN-6 step with OPT gs", "opt_train_step_cnn6_w64_b128", "gs", 1.3),
    Goal(27, "CNN-6 step with OPT cayley", "opt_train_step_cnn6_w64_b128", "cayley", 1.3),
    Goal(27, "CNN-6 step with OPT householder", "opt_train_step_cnn6_w64_b128", "householder", 1.5),
)
ENERGY_LIMIT = 2.0  # issue 29: fused energy forward + backward within 2x of three TF32 Gram products (N = 32,768)
HUGE_LIMIT_S = 60.0  # issue 29: N = 2^20, d = 512 in under a minute


def _load(stem: str, device: str, results: Path) -> dict | None:
    path = results / f"{stem}-{device}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def status(goal: Goal, device: str = "cuda", results: Path = RESULTS) -> dict:
    """{"ratio", "met", "device", "date"} of ``goal`` in the saved result (ratio and met None: not measured)."""
    result = _load(goal.stem, device, results) or {}
    ratios = next((v for k, v in result.items() if k.startswith("ratio_to_") and isinstance(v, dict)), {})
    ratio = ratios.get(goal.candidate)
    return {"ratio": ratio, "met": None if ratio is None else ratio <= goal.limit,
            "device": result.get("device"), "date": (result.get("date") or "")[:10] or None}


def energy_status(device: str = "cuda", results: Path = RESULTS) -> list[dict]:
    """The energy goals of issue 29 from ``energy_fwd_bwd-<device>.json``: one row per Triton backend's TF32 run at
    N = 32,768 (against three Gram products at "high") and per N = 2^20 run."""
    result = _load("energy_fwd_bwd", device, results) or {}
    rows = []
    for run in result.get("runs", []):
        backend = run.get("backend", "triton")
        if run.get("kind") in ("fused_suite", "triton_suite"):
            high = run.get("precisions", {}).get("high")
            ratio = None if high is None else high["seconds"] / high["gram_seconds"]
            rows.append({"what": f"energy {backend}, N={run['n']:,}, d={run['d']}, TF32", "figure": ratio,
                         "unit": "x three Gram products", "limit": ENERGY_LIMIT, "error": run.get("error")})
        elif run.get("kind") == "huge":
            rows.append({"what": f"energy {backend}, N={run['n']:,}, d={run['d']}", "figure": run.get("seconds"),
                         "unit": "s", "limit": HUGE_LIMIT_S, "error": run.get("error")})
    for row in rows:
        row["met"] = None if row["figure"] is None else row["figure"] <= row["limit"]
        row.update(device=result.get("device"), date=(result.get("date") or "")[:10] or None)
    return rows


def _verdict(met: bool | None, error: str | None = None) -> str:
    if met is None:
        return f"failed ({error[:60]})" if error else "not measured"
    return "met" if met else "missed"


def report(device: str = "cuda", results: Path = RESULTS) -> list[str]:
    """One Markdown table row per goal: issue, setting, last figure, goal, verdict, device and date."""
    lines = ["| issue | setting | last measured | goal | verdict | device, date |", "|---|---|---:|---:|---|---|"]
    for goal in GOALS:
        s = status(goal, device, results)
        figure = "—" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        lines.append(f"| {goal.issue} | {goal.what} | {figure} | ≤ {goal.limit:g}x | {_verdict(s['met'])} | "
                     f"{s['device'] or '—'}, {s['date'] or '—'} |")
    energy = energy_status(device, results) or [{"what": "energy, N=32,768, d=512, TF32", "figure": None, "met": None,
                                                 "unit": "x three Gram products", "limit": ENERGY_LIMIT,
                                                 "error": None, "device": None, "date": None}]
    for row in energy:
        figure = "—" if row["figure"] is None else f"{row['figure']:.2f} {row['unit']}"
        lines.append(f"| 29 | {row['what']} | {figure} | ≤ {row['limit']:g} {row['unit']} | "
                     f"{_verdict(row['met'], row['error'])} | {row['device'] or '—'}, {row['date'] or '—'} |")
    return lines


if __name__ == "__main__":
    print("\n".join(report(sys.argv[1] if len(sys.argv) > 1 else "cuda")))

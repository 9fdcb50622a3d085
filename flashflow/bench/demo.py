"""What `flashflow bench` shows on a machine without a GPU: flashflow's attention run through
Triton's CPU interpreter on a few small, odd shapes, compared with the float64 reference.

Run as ``TRITON_INTERPRET=1 python -m flashflow.bench.demo``; the variable must be set before
Triton is imported, which is why `flashflow bench` starts this module in a fresh process.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DemoCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    tolerance: float  # relative Frobenius error vs float64; fp16 inputs round to ~5e-4

    @property
    def label(self) -> str:
        gqa = f" gqa {self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return (f"b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k} h{self.heads} d{self.head_dim}"
                f"{gqa}{' causal' if self.causal else ''}")


# Sizes that are not multiples of any block size, so the masked edge loops run too.
CASES = (
    DemoCase(2, 50, 50, 3, 3, 40, False, torch.float32, 1e-4),
    DemoCase(1, 37, 67, 4, 2, 64, True, torch.float16, 5e-3),
    DemoCase(1, 96, 96, 2, 1, 128, True, torch.float32, 1e-4),
)


def run_case(case: DemoCase, seed: int = 0) -> float:
    """flashflow's output vs :func:`attention_naive` in float64: relative Frobenius error."""
    import flashflow
    from flashflow.reference import attention_naive

    gen = torch.Generator().manual_seed(seed)

    def rand(seqlen, heads):
        return torch.randn(case.batch, seqlen, heads, case.head_dim, generator=gen).to(case.dtype)

    q = rand(case.seqlen_q, case.heads)
    k, v = rand(case.seqlen_k, case.kv_heads), rand(case.seqlen_k, case.kv_heads)
    out = flashflow.flash_attn_func(q, k, v, causal=case.causal)
    ref = attention_naive(q.double(), k.double(), v.double(), causal=case.causal)
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> int:
    from flashflow.device import interpreting

    if not interpreting():
        print("flashflow.bench.demo runs on the CPU through Triton's interpreter: "
              "set TRITON_INTERPRET=1 before starting it.", file=sys.stderr)
        return 2
    print("Correctness demo (Triton interpreter, CPU): flashflow.flash_attn_func vs the float64 "
          "reference")
    width = max(len(c.label) for c in CASES)
    failed = 0
    for case in CASES:
        err = run_case(case)
        ok = err <= case.tolerance
        failed += not ok
        dtype = str(case.dtype).removeprefix("torch.")
        print(f"  {case.label:<{width}}  {dtype:<7}  rel err {err:.2e}  "
              f"(tolerance {case.tolerance:.0e})  {'ok' if ok else 'FAILED'}", flush=True)
    print(f"{len(CASES) - failed}/{len(CASES)} cases within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

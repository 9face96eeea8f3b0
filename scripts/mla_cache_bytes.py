"""Bytes per token of colibri's KV cache for the DeepSeek geometries: the MLA cache (the
latent and the rotary key, colibri/engine/mla.py) against the per-head K/V layout of the same heads.

    python scripts/mla_cache_bytes.py        # a Markdown table (docs/families.md)

KVCache allocates lazily (np.zeros), so the caches made here cost no memory.
"""
from colibri.engine.kv_cache import KVCache

GEOMETRIES = {  # name: layers, heads, Dn, Dr, Dv, Rkv (config.json of the hub checkpoints)
    "DeepSeek-V2-Lite": (27, 16, 128, 64, 128, 512),
    "DeepSeek-V2 / V2.5": (60, 128, 128, 64, 128, 512),
    "DeepSeek-V3 / R1": (61, 128, 128, 64, 128, 512),
}


def main() -> None:
    print("| geometry | MLA cache B/token | per-head K/V B/token | ratio | MLA, 4096 tokens "
          "| per-head, 4096 tokens |")
    print("|---|---|---|---|---|---|")
    for name, (L, H, Dn, Dr, Dv, R) in GEOMETRIES.items():
        mla = KVCache(L, 1, 1, 1, R, value_dim=Dr).bytes_per_token
        naive = KVCache(L, 1, H, 1, Dn + Dr, value_dim=Dv).bytes_per_token
        print(f"| {name} | {mla:,} | {naive:,} | {naive / mla:.1f}x | "
              f"{mla * 4096 / 2**20:.0f} MiB | {naive * 4096 / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()

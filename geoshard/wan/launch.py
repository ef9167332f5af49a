"""A training job under the WAN rehearsal: each region's torchrun agent inside its region's
namespace, the plan's loopback S3 endpoints served from their regions (``geoshard train --wan``
and the demo)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geoshard.trainer.config import RegionRanks, TrainConfig


def launch_under_wan(
    cfg: TrainConfig,
    regions: Sequence[RegionRanks],
    max_restarts: int,
    matrix_path: Path,
    echo: Callable[[str], Any],
    env: Mapping[str, str] | None = None,
) -> int:
    """The job with each region's agent in that region's namespace; loopback S3 endpoints of the plan
    are served from their region's namespace. RUN_DIR/wan.json records the matrix, the forwarder's
    ceiling and the bytes that crossed each link. ``env`` adds variables for the ranks."""
    from geoshard.trainer.launch import RegionNet, launch_regions
    from geoshard.wan import Rehearsal, load_matrix, netns, require_root
    from geoshard.wan.localize import localize_endpoints

    require_root()
    matrix = load_matrix(matrix_path)
    with Rehearsal(matrix, regions=[r.region for r in regions]) as wan:
        echo(f"WAN rehearsal: {', '.join(r.region for r in regions)} in their own network namespaces behind {matrix_path}; {wan.ceiling}")
        cfg.out.mkdir(parents=True, exist_ok=True)
        plan = cfg.out / "plan-wan.toml"
        plan.write_text(localize_endpoints(cfg.plan.read_text(), wan.expose))
        net = RegionNet(
            address=wan.address,
            wrap=wan.exec_argv,
            # TORCH_CPP_LOG_LEVEL: c10d warns on every connection that a namespace address has no host name.
            env=lambda r: {**wan.env(r), "TORCH_CPP_LOG_LEVEL": "ERROR"},
            inside=lambda r: netns.inside(wan.netns(r)),
        )
        # DiLoCo p2p orders its rings by the matrix's bandwidths (unless the user named another matrix)
        outer_wan = cfg.outer_wan or (str(Path(matrix_path).resolve()) if cfg.outer_transport == "p2p" else None)
        job_cfg = dataclasses.replace(cfg, plan=plan, outer_wan=outer_wan)
        code = launch_regions(job_cfg, regions, max_restarts, env=env, net=net)
        counters = wan.counters()
        links: list[dict[str, Any]] = [{"from": a, "to": b, "bytes": n, "packets": k} for (a, b), (n, k) in sorted(counters.items())]
        record = {
            "matrix": str(matrix_path),
            "ceiling": {"packets_per_s": wan.ceiling.packets_per_s, "mb_per_s": wan.ceiling.mb_per_s},
            "links": links,
        }
    (cfg.out / "wan.json").write_text(json.dumps(record, indent=1))
    total = sum(int(x["bytes"]) for x in links)
    echo(f"WAN rehearsal: {total / 1e6:,.1f} MB crossed between regions ({cfg.out / 'wan.json'}); {wan.ceiling}")
    return code

"""Prints each run's lockstep probe rounds from its events (bench/run_tri_accel.sh chunks|lockstep): step, seconds,
passes, the eager pass and capture, one replayed pass, the graph's pool, the credit left, and the run's peak."""
import glob
import json
import sys

for path in sorted(glob.glob(f"{sys.argv[1]}/*.events.jsonl")):
    events = [json.loads(line) for line in open(path) if line.strip()]
    summary = next((e for e in events if e["event"] == "summary"), {})
    print(f"{path.split('/')[-1]}: peak {summary.get('peak_vram_gb')} GB, {summary.get('epoch_s')} s/epoch, "
          f"probe share {summary.get('probe_share')}, acc {summary.get('test_acc')}")
    for e in events:
        if e["event"] != "curvature" or "probe_s" not in e:
            continue
        r = e.get("round") or {}
        print(f"  step {e['step']:5} probe {e['probe_s']:.3f} s, {len(e['probed'])} units, passes {r.get('passes')}, "
              f"eager {r.get('eager_s', 0):.3f}, capture {r.get('capture_s', 0):.3f}, replay {r.get('replay_s')}, "
              f"pool {r.get('graph_bytes', 0) / 1e6:.0f} MB, credit {e['credit_s']:.3f}, alpha {e['alpha']:.4g}")

#!/usr/bin/env python3
"""Checks deploy/k8s: every manifest parses, every container runs a kvpool binary, and
every flag a manifest passes is one that binary accepts (its --help lists it), so the
manifests cannot drift from the code; and every worker's --model is among the router's
--models (the router refuses to register a worker of a model it does not serve).

Usage: check_manifests.py <manifest dir> <binary name>=<path> ...
"""
import glob
import os
import re
import subprocess
import sys

import yaml


def container_commands(doc):
    spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
    for c in spec.get("containers", []):
        words = list(c.get("command", [])) + list(c.get("args", []))
        if words[:2] == ["sh", "-c"]:
            words = " ".join(words[2:]).split()
        yield c.get("name"), words


def main():
    manifest_dir, binaries = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
    help_text = {}
    for name, path in binaries.items():
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
        help_text[name] = out.stdout + out.stderr
    errors, checked = [], 0
    router_models, worker_models = set(), []
    for path in sorted(glob.glob(os.path.join(manifest_dir, "*.yaml"))):
        for doc in yaml.safe_load_all(open(path)):
            if not doc or doc.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                continue
            for cname, words in container_commands(doc):
                binary = next((w for w in words if w in binaries), None)
                if binary is None:
                    errors.append(f"{path}: container {cname} runs none of {sorted(binaries)}: {words}")
                    continue
                for w in words:
                    mm = re.match(r"^--models?=(.*)$", w)
                    if mm and binary == "kvpool-router":
                        router_models.update(x for x in mm.group(1).split(",") if x)
                    elif mm and binary == "kvpool-worker":
                        worker_models.append((path, mm.group(1)))
                    m = re.match(r"^(--[a-z0-9-]+)", w)
                    if not m:
                        continue
                    checked += 1
                    if not re.search(re.escape(m.group(1)) + r"\b", help_text[binary]):
                        errors.append(f"{path}: {binary} does not accept {m.group(1)}")
    for path, model in worker_models:
        if model not in router_models:
            errors.append(f"{path}: kvpool-worker --model={model} is not in kvpool-router's "
                          f"--models ({sorted(router_models)}): the router would refuse its Register")
    for e in errors:
        print("error:", e)
    print(f"checked {checked} flags in {manifest_dir}: {len(errors)} errors")
    return 1 if errors or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())

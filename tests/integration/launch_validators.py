"""Run by the launchers' own virtual environment (`.venv/launchers`, scripts/install-frameworks.sh):
each launcher's file read by the real tool's parser, the result printed as JSON.

    python launch_validators.py k8s FILE        the PyTorchJob against the training operator's
                                                generated models (kubeflow-training, its
                                                OpenAPI schema): every key known, every type
    python launch_validators.py skypilot FILE   SkyPilot's own `Task.from_yaml`
"""

from __future__ import annotations

import json
import re
import sys

import yaml


def _model(name: str) -> type:
    import kubeflow.training.models as kubeflow
    import kubernetes.client.models as kubernetes

    return getattr(kubeflow, name, None) or getattr(kubernetes, name)


def check(value: object, kind: str, where: str) -> None:
    """`value` against an OpenAPI-generated type name ('str', 'dict(str, X)', 'list[X]', a
    model): unknown keys, wrong types and missing required fields raise."""
    if kind in ("str", "object"):
        assert kind == "object" or isinstance(value, str), f"{where}: {value!r} is not a string"
    elif kind == "int":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: not an int"
    elif kind == "bool":
        assert isinstance(value, bool), f"{where}: not a bool"
    elif match := re.fullmatch(r"dict\(str, (.+)\)", kind):
        assert isinstance(value, dict), f"{where}: not a mapping"
        for key, item in value.items():
            check(item, match[1], f"{where}.{key}")
    elif match := re.fullmatch(r"list\[(.+)\]", kind):
        assert isinstance(value, list), f"{where}: not a list"
        for i, item in enumerate(value):
            check(item, match[1], f"{where}[{i}]")
    else:
        model = _model(kind)
        assert isinstance(value, dict), f"{where}: a {kind} is a mapping"
        fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
        unknown = set(value) - set(fields)
        assert not unknown, f"{where}: {kind} has no field {sorted(unknown)}"
        for key, item in value.items():
            check(item, model.openapi_types[fields[key]], f"{where}.{key}")
        # the generated constructor rejects a missing required field
        model(**{fields[key]: item for key, item in value.items()})


def main() -> None:
    what, path = sys.argv[1], sys.argv[2]
    if what == "k8s":
        with open(path) as f:
            job = yaml.safe_load(f)
        check(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob")
        specs = job["spec"]["pytorchReplicaSpecs"]
        print(json.dumps({name: {"replicas": spec["replicas"],
                                 "command": spec["template"]["spec"]["containers"][0]["command"],
                                 "gpus": spec["template"]["spec"]["containers"][0]["resources"]
                                 ["limits"]["nvidia.com/gpu"]}
                          for name, spec in specs.items()} | {"nproc": job["spec"]
                                                              ["nprocPerNode"]}))
    elif what == "skypilot":
        import sky

        task = sky.Task.from_yaml(path)
        (resources,) = list(task.resources)
        print(json.dumps({"num_nodes": task.num_nodes, "accelerators": resources.accelerators,
                          "run": task.run, "envs": dict(task.envs)}))
    else:
        raise SystemExit(f"unknown check {what!r}")


if __name__ == "__main__":
    main()

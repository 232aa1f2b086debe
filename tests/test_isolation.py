"""The model library stands alone: importing it pulls in no Lightning, W&B, OmegaConf or timm."""

import subprocess
import sys


def test_model_library_imports_no_training_stack():
    code = (
        "import sys, mmformer.nn, mmformer.models, mmformer.tokenizers, mmformer.tokenizers.audio,"
        " mmformer.models.pretrained, mmformer.nn.lora, mmformer.models.diffusion, mmformer.tokenizers.diffusion;"
        "print([m for m in ('lightning', 'pytorch_lightning', 'wandb', 'omegaconf', 'timm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_registry_is_a_leaf():
    """``mmformer.registry`` imports nothing of mmformer: asking for it loads no Lightning or data code."""
    code = (
        "import sys, mmformer.registry;"
        "print(sorted(m for m in sys.modules if m.startswith(('mmformer.', 'lightning'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['mmformer.registry']"


def test_no_import_cycles_between_mmformer_modules():
    """The module-level imports of the package form no cycle (a cycle hides the layering)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules = {}
    for path in (root / "mmformer").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.parse(path.read_text()).body:  # top-level imports only
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = (
                    ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                )
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    graph[name].add(full if full in modules else target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names)
        graph[name] = {t for t in graph[name] if t in modules and t != name}

    def cycle_from(start, node, seen):
        for nxt in graph[node]:
            if nxt == start:
                return [node, nxt]
            if nxt not in seen:
                seen.add(nxt)
                path = cycle_from(start, nxt, seen)
                if path:
                    return [node, *path]
        return None

    cycles = [c for m in graph if (c := cycle_from(m, m, {m}))]
    assert not cycles, f"import cycle: {' -> '.join(cycles[0])}"

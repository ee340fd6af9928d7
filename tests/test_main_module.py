"""Code defined in the kernel's __main__ (a notebook's cells, a script) works in the ranks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)


def test_functions_classes_and_lambdas_from_main_travel_by_value(script, tmp_path):
    kernel = script(
        """
        import nbshard

        class Scaler:
            def __init__(self, factor):
                self.factor = factor
            def __call__(self, x):
                return x * self.factor

        offset = 100
        add_offset = lambda x: x + offset

        def train(scaler):
            import os
            return add_offset(scaler(int(os.environ["RANK"]) + 1))

        print("values:", nbshard.run(train, Scaler(10), nproc=2, return_all=True))
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    assert "values: [110, 120]" in out


def test_pickling_by_reference_in_the_ranks_finds_main_classes(script, tmp_path):
    # torch.save pickles the model's class by reference (__main__.TinyNet), and
    # DataLoader workers started with spawn unpickle __main__.Squares: both must
    # be found in the ranks although they were defined in the kernel's __main__.
    checkpoint = tmp_path / "model.pt"
    kernel = script(
        f"""
        import torch, nbshard

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, index):
                return torch.tensor([float(index * index)])

        class TinyNet(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(1, 1)

        def train(path):
            import os
            rank = int(os.environ["RANK"])
            totals = {{}}
            for method in ("fork", "spawn"):
                loader = torch.utils.data.DataLoader(
                    Squares(), batch_size=4, num_workers=2, multiprocessing_context=method)
                totals[method] = sum(batch.sum().item() for batch in loader)
            if rank == 0:
                torch.save(TinyNet(), path)
                reloaded = torch.load(path, weights_only=False)
                totals["reloaded"] = type(reloaded).__name__
            return totals

        print("totals:", nbshard.run(train, {str(checkpoint)!r}, nproc=2))
        model = torch.load({str(checkpoint)!r}, weights_only=False)
        print("kernel loaded:", type(model).__name__, isinstance(model, TinyNet))
        """
    )
    code, out = kernel.finish(timeout=150)
    assert code == 0, out
    assert "totals: {'fork': 140.0, 'spawn': 140.0, 'reloaded': 'TinyNet'}" in out
    assert "kernel loaded: TinyNet True" in out


def test_a_failure_in_main_code_shows_its_source_lines(script):
    kernel = script(
        """
        import nbshard

        def check(value):
            if value < 0:
                raise ValueError(f"negative value: {value}")

        def train():
            check(-1)

        try:
            nbshard.run(train, nproc=2)
        except nbshard.JobFailed as error:
            import traceback
            print("".join(traceback.format_exception(error.__cause__)))
        """
    )
    code, out = kernel.finish()
    assert code == 0, out
    remote = out[out.index("\nTraceback"):]  # the kernel's rendering, not the streamed rank output
    assert "(raised in rank" in remote
    assert "kernel_script.py\", line 9, in train" in remote and "    check(-1)" in remote
    assert "raise ValueError(f\"negative value: {value}\")" in remote
    assert "ValueError: negative value: -1" in remote

"""Lightning jobs: the Trainer and Fabric built inside the ranks, as under torchrun."""

from __future__ import annotations

import os

import torch


def _data():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fit_model_parallel(model, loader, epochs):
    """A CPU Trainer with ModelParallelStrategy (FSDP2) over every rank, fitted; returns the Trainer."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    )
    trainer.fit(model, loader)
    return trainer


def trainer_model_parallel(epochs):
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
            self.losses = []

        def configure_model(self):
            _shard(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Regressor()
    trainer = _fit_model_parallel(model, torch.utils.data.DataLoader(_data(), batch_size=32), epochs)
    world = int(os.environ["WORLD_SIZE"])
    weight = model.net[0].weight
    return {
        "first": model.losses[0], "last": model.losses[-1], "world_size": trainer.world_size,
        "launched_by": type(trainer.strategy.cluster_environment).__name__,
        "sharded": type(weight).__name__ == "DTensor" and weight.to_local().shape[0] == 32 // world,
    }


def trainer_build_sharded_language_model(epochs):
    """build_sharded in configure_model, on Lightning's mesh: the embedding and head gathered in chunks."""
    import lightning as L

    from nbshard import fsdp
    from sharded_models import RotaryLM

    class LanguageModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.losses = []

        def configure_model(self):
            self.lm = fsdp.build_sharded(lambda: RotaryLM(vocab=1001, tie=False), mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, index):
            (tokens,) = batch
            logits = self.lm(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())  # learn to copy
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = LanguageModel()
    tokens = torch.randint(0, 1001, (64, 8), generator=torch.Generator().manual_seed(0))
    _fit_model_parallel(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8), epochs)
    return {"first": model.losses[0], "last": model.losses[-1],
            "chunked": sorted(n for n, m in model.lm.named_modules() if hasattr(m, "_nbshard_rows"))}


def trainer_notebook_strategy(strategy, epochs, devices=None):
    """A Trainer with one of Lightning's process-starting strategies (``ddp_notebook``: what a
    notebook's Lightning code uses): where it trained, and the weights after it."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 1)
            self.losses, self.pids = [], set()

        def training_step(self, batch, _):
            self.pids.add(os.getpid())
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(int(os.environ["RANK"]))  # different starting weights: DDP makes them one
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=devices or world, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=32))
    return {"world_size": trainer.world_size, "global_rank": trainer.global_rank, "pids": model.pids, "pid": os.getpid(),
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "first": sum(model.losses[:4]) / 4, "last": sum(model.losses[-4:]) / 4}  # an epoch's mean: 4 batches a rank


def fabric_notebook_launch(strategy):
    """``Fabric.launch(fn)`` with a process-starting strategy: where ``fn`` ran, and its group."""
    import lightning as L

    def where(fabric):
        return {"pid": os.getpid(), "world_size": fabric.world_size, "global_rank": fabric.global_rank,
                "sum": fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()}

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    return {**fabric.launch(where), "rank_pid": os.getpid()}


def fabric_empty_init(steps):
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    world = int(os.environ["WORLD_SIZE"])
    fabric = L.Fabric(
        accelerator="cpu", devices=world,
        strategy=ModelParallelStrategy(lambda model, mesh: _shard(model, mesh["data_parallel"]), data_parallel_size=world, tensor_parallel_size=1),
    )
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model = fabric.setup(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.reset_parameters()
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _data().tensors
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"on_meta": on_meta, "first": losses[0], "last": losses[-1], "world_size": fabric.world_size}


def trainer_fsdp_on_gpus(epochs):
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="gpu", devices=world, strategy="fsdp", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(_data(), batch_size=32))
    return trainer.world_size

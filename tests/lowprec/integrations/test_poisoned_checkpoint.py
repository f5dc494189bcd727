"""The integrations refuse to save a checkpoint after NonfiniteGuard saw NaN, unless allow_poisoned_checkpoint."""

from __future__ import annotations

import pytest
import torch

import lowprec
from nvdlfw_inspect.errors import PoisonedCheckpointError

CONFIG = {
    "guard": {
        "enabled": True,
        "layers": {"layer_name_regex_pattern": ".*"},
        "transformer_engine": {"NonfiniteGuard": {"enabled": True}},
    }
}
RECIPE = lowprec.MXFP8BlockScaling()


class Net(torch.nn.Module):
    """Returns ``{"loss": ...}`` as a Hugging Face model does; the NaN goes into ``fc1``'s gradient at call ``poison_at``."""

    def __init__(self, poison_at: int | None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = lowprec.Linear(32, 32)
        self.fc2 = lowprec.Linear(32, 32)
        self.calls, self.poison_at = 0, poison_at

    def forward(self, x, labels=None):
        y = self.fc1(x)
        if self.calls == self.poison_at:
            y.register_hook(lambda grad: grad * float("nan"))
        self.calls += 1
        return {"loss": self.fc2(y).float().pow(2).mean()}


def samples(n: int = 8) -> list[dict]:
    torch.manual_seed(1)
    return [{"x": torch.randn(32), "labels": torch.zeros(1)} for _ in range(n)]


def test_lightning_refuses_a_poisoned_checkpoint(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lowprec.integrations.lightning import DebugCallback

    class Lit(pl.LightningModule):
        def __init__(self, poison_at):
            super().__init__()
            self.net = Net(poison_at)

        def training_step(self, batch, batch_idx):
            return self.net(batch["x"])["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(poison_at, **options):
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=2,
            callbacks=[DebugCallback(CONFIG, log_dir=tmp_path / "logs", recipe=RECIPE, **options)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Lit(poison_at), torch.utils.data.DataLoader(samples(), batch_size=4))
        return trainer

    with pytest.warns(RuntimeWarning, match="first in layer model.fc1, tensor gradient"):
        trainer = fit(poison_at=1)
    with pytest.raises(PoisonedCheckpointError, match="layer model.fc1, tensor gradient .* micro-batch 0"):
        trainer.save_checkpoint(tmp_path / "poisoned.ckpt")
    assert not (tmp_path / "poisoned.ckpt").exists()
    with pytest.warns(RuntimeWarning):
        fit(poison_at=1, allow_poisoned_checkpoint=True).save_checkpoint(tmp_path / "allowed.ckpt")
    fit(poison_at=None).save_checkpoint(tmp_path / "clean.ckpt")
    assert (tmp_path / "allowed.ckpt").exists() and (tmp_path / "clean.ckpt").exists()


def test_hf_trainer_refuses_to_save_after_a_poisoned_step(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lowprec.integrations.hf import DebugCallback

    def train(poison_at, **options):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=2,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=1,
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        callback = DebugCallback(CONFIG, log_dir=tmp_path / "logs", recipe=RECIPE, **options)
        trainer = transformers.Trainer(model=Net(poison_at), args=args, train_dataset=samples(), callbacks=[callback])
        with callback:
            trainer.train()

    with pytest.warns(RuntimeWarning), pytest.raises(PoisonedCheckpointError, match="layer model.fc1, tensor gradient"):
        train(poison_at=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-1"]  # the clean step's only
    with pytest.warns(RuntimeWarning):
        train(poison_at=1, allow_poisoned_checkpoint=True)
    assert (tmp_path / "out" / "checkpoint-2").exists()


def test_accelerate_refuses_to_save_after_a_poisoned_step(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from lowprec.integrations.accelerate import DebugRun

    def train(poison_at, save_to, **options):
        accelerator = accelerate.Accelerator(cpu=True)
        model = Net(poison_at)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(samples(), batch_size=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        with DebugRun(accelerator, model, CONFIG, log_dir=tmp_path / "logs", recipe=RECIPE, **options) as run:
            for batch in loader:
                accelerator.backward(model(batch["x"])["loss"])
                optimizer.step()
                optimizer.zero_grad()
                run.step()
            accelerator.save_state(save_to / "state")
            accelerator.save_model(model, save_to / "model")
        assert "save_state" not in vars(accelerator)  # the run's check is gone with the run

    with pytest.warns(RuntimeWarning), pytest.raises(PoisonedCheckpointError, match="layer model.fc1, tensor gradient"):
        train(poison_at=1, save_to=tmp_path / "poisoned")
    assert not (tmp_path / "poisoned").exists()
    with pytest.warns(RuntimeWarning):
        train(poison_at=1, save_to=tmp_path / "allowed", allow_poisoned_checkpoint=True)
    train(poison_at=None, save_to=tmp_path / "clean")
    for run in ("allowed", "clean"):
        assert any((tmp_path / run / "state").iterdir()) and any((tmp_path / run / "model").iterdir())

"""The training loop both tiny models share: batches made by a pool of worker processes
(drawing scenes and clips is the slow part; the GPU waits on one core otherwise), each a
pure function of its step number, so a run is reproducible whatever the worker count;
AdamW with a one-cycle schedule, bf16 autocast on the GPU, gradient clipping."""

import time

import torch


class Steps(torch.utils.data.Dataset):
    """Step `i`'s batch, made by `make(i)` in whichever worker gets it."""

    def __init__(self, make, steps):
        self.make, self.steps = make, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.make(i)


def train(model, make, steps, lr, device, workers):
    """Trains `model` on `make(step) -> dict of CPU tensors` (the model's keyword arguments,
    `labels` among them)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    loader = torch.utils.data.DataLoader(Steps(make, steps), batch_size=None, num_workers=workers,
                                         prefetch_factor=4 if workers else None, persistent_workers=False)
    t0 = time.time()
    model.train()
    for step, batch in enumerate(loader):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    return model

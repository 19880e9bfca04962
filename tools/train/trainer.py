"""The training loop both tiny models share: batches made by a pool of worker processes
(drawing scenes and clips is the slow part; the GPU waits on one core otherwise), each a
pure function of its step number, so a run is reproducible whatever the worker count;
AdamW with a one-cycle schedule, bf16 autocast on the GPU, gradient clipping."""

import json
import os
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


def train(model, make, steps, lr, device, workers, max_seconds=0):
    """Trains `model` on `make(step) -> dict of CPU tensors` (the model's keyword arguments,
    `labels` among them). With `max_seconds`, stops early once that much time has passed
    (the GPU machine runs a command for at most 10 minutes), keeping what it has learnt."""
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
        late = max_seconds and time.time() - t0 > max_seconds
        if step % 250 == 0 or step == steps - 1 or late:
            extra = f", {model.report()}" if hasattr(model, "report") else ""
            print(f"step {step} loss {loss.item():.4f}{extra} ({time.time() - t0:.0f} s)", flush=True)
        if late:
            print(f"stopped at step {step} of {steps}: over {max_seconds} s", flush=True)
            break
    return model


def add_args(ap, steps, evals):
    """The flags both training scripts take."""
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eval", type=int, default=evals)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=0, help="stop training early after this long")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() - 1))


class Tally:
    """Exact-match answers per question type, and every answer given."""

    def __init__(self):
        self.right, self.total, self.rows = {}, {}, []

    def add(self, seed, kind, question, answer, got):
        self.total[kind] = self.total.get(kind, 0) + 1
        self.right[kind] = self.right.get(kind, 0) + int(got == answer)
        self.rows.append({"seed": seed, "kind": kind, "question": question, "answer": answer, "got": got})

    def scores(self):
        return {k: self.right[k] / self.total[k] for k in sorted(self.total)}


def ship(model, out, steps, evaluate):
    """Saves `model` in bf16 (what ships) and writes `eval.json` with `evaluate(model)`'s
    tally, scored on the bf16 weights."""
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    model.eval()
    with torch.no_grad():
        tally = evaluate(model)
    scores = tally.scores()
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump({"scores": scores, "steps": steps, "items": tally.rows}, f, indent=1)
    print(json.dumps(scores), flush=True)

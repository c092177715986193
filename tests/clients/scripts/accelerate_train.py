"""A Hugging Face Accelerate training script, written the way Accelerate's own examples are.

Nothing in it knows about elastrun: ``Accelerator()`` reads the launcher's environment, ``prepare``
wraps the model, optimizer and data loader, ``accelerator.backward`` and ``gather_for_metrics`` do
the distributed work, ``save_state``/``load_state`` checkpoint and resume (``--output-dir``).

    torchrun --nproc-per-node=2 accelerate_train.py --output-dir ckpt
    elastrun --nproc-per-node=2 accelerate_train.py --output-dir ckpt
"""

import argparse
import os
import time

import step_times
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def make_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """A linearly separable two-class problem with a little noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is heavier")
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = torch.utils.data.DataLoader(make_data(512, 0), batch_size=args.batch_size, shuffle=True)
    evaluate = torch.utils.data.DataLoader(make_data(128, 1), batch_size=args.batch_size)
    model, optimizer, train, evaluate = accelerator.prepare(model, optimizer, train, evaluate)
    accelerator.print(f"num_processes {accelerator.num_processes} distributed_type {accelerator.distributed_type}")

    # One directory per epoch; its "complete" file is written once every process saved its part.
    done = [int(d.split("_")[1]) for d in os.listdir(args.output_dir) if d.startswith("epoch_")
            and os.path.exists(os.path.join(args.output_dir, d, "complete"))] if os.path.isdir(args.output_dir) else []
    first_epoch = 0
    if done:
        last = os.path.join(args.output_dir, f"epoch_{max(done)}")
        accelerator.load_state(last)
        first_epoch = max(done) + 1
        accelerator.print(f"resumed from {last} at epoch {first_epoch}")

    for epoch in range(first_epoch, args.epochs):
        model.train()
        for i, (x, y) in enumerate(train):
            t0 = step_times.begin()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_seconds)
            step_times.end(epoch, i, t0)
        model.eval()
        correct = total = 0
        for x, y in evaluate:
            with torch.no_grad():
                pred = model(x).argmax(-1)
            pred, y = accelerator.gather_for_metrics((pred, y))
            correct += (pred == y).sum().item()
            total += y.numel()
        accelerator.print(f"epoch {epoch} accuracy {correct / total:.3f} on {total} samples")
        path = os.path.join(args.output_dir, f"epoch_{epoch}")
        accelerator.save_state(path)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            open(os.path.join(path, "complete"), "w").close()
        accelerator.wait_for_everyone()
    accelerator.print(f"done: {args.epochs} epochs")
    accelerator.end_training()


if __name__ == "__main__":
    main()

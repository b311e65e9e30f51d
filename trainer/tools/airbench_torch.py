"""The peer of trainer.tools.peer_benchmark: airbench's own PyTorch code (PyPI
package airbench 0.1.8, lib_airbench94 + utils) run on this CPU. Run by
peer_benchmark in a Python that has torch, torchvision and airbench (`pip install
-e ".[peer]"`); it never imports TensorFlow or this project.

    python trainer/tools/airbench_torch.py --data=DIR/cifar10.npz --work_dir=DIR \\
        --seed=0 --epochs=5 --widths=32:64:128 [--profile_steps=20]

Every change made to the peer, and nothing else (the rest is airbench's code, called
as the package ships it):
1. Device: the CPU. make_net94 ends in `net.half().cuda()`; `make_net` below is
   make_net94 without that line: fp32 master weights on the CPU, batch-norm fp32 as
   in airbench. The forward runs under `torch.autocast('cpu', dtype=torch.bfloat16)`
   (bf16 convolutions, as our mixed_bfloat16), instead of fp16 weights.
2. The loaders are airbench's CifarLoader with gpu='cpu' (its own argument; the
   default 0 means cuda:0), reading train.pt/test.pt written from our TFDS copy of
   CIFAR-10 (same images, same order) instead of torchvision's download.
3. Timing: torch.cuda.Event/synchronize replaced by a wall clock (perf_counter).
   The training seconds are airbench's own total_time_seconds after the last
   epoch (whitening init and the training epochs, with the loader's augmentation),
   read from its table's rows; its final row adds the TTA evaluation, which is left
   out here, as ours leaves evaluation out.
4. torch.set_num_threads(--threads, default 2: both cores).
5. Widths and epochs from the flags (airbench_small: 32:64:128, 5 epochs).
6. The seed: torch.manual_seed(--seed) before the run.
"""
import json
import os
import time

from absl import app, flags
import numpy as np
import torch
from torch import nn

from airbench import lib_airbench94 as ab94
from airbench import utils as ab_utils


class _WallClockEvent:
    """torch.cuda.Event's timing interface on the CPU (change 3)."""

    def __init__(self, enable_timing: bool = True):
        self.time = None

    def record(self) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return 1e3 * (end.time - self.time)  # milliseconds, as CUDA's


class _AutocastSequential(nn.Sequential):
    """make_net94's Sequential, its forward in bf16 autocast (change 1)."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x)


def make_net(widths: dict, batchnorm_momentum: float = ab94.hyp["net"]["batchnorm_momentum"]):
    """lib_airbench94.make_net94, without `.half().cuda()` (change 1)."""
    whiten_kernel_size = 2
    whiten_width = 2 * 3 * whiten_kernel_size**2
    net = _AutocastSequential(
        ab94.Conv(3, whiten_width, whiten_kernel_size, padding=0, bias=True),
        nn.GELU(),
        ab94.ConvGroup(whiten_width, widths["block1"], batchnorm_momentum),
        ab94.ConvGroup(widths["block1"], widths["block2"], batchnorm_momentum),
        ab94.ConvGroup(widths["block2"], widths["block3"], batchnorm_momentum),
        nn.MaxPool2d(3),
        ab94.Flatten(),
        nn.Linear(widths["block3"], 10, bias=False),
        ab94.Mul(ab94.hyp["net"]["scaling_factor"]),
    )
    net[0].weight.requires_grad = False
    net = net.to(memory_format=torch.channels_last)
    for mod in net.modules():
        if isinstance(mod, ab94.BatchNorm):
            mod.float()
    return net


def write_loader_files(npz_path: str, directory: str) -> None:
    """train.pt and test.pt as CifarLoader reads them (change 2)."""
    data = np.load(npz_path)
    classes = [str(name) for name in data["classes"]]
    for split in ("train", "test"):
        torch.save({"images": torch.tensor(data[f"{split}_images"]),
                    "labels": torch.tensor(data[f"{split}_labels"].astype(np.int64)),
                    "classes": classes}, os.path.join(directory, f"{split}.pt"))


FLAGS = flags.FLAGS
flags.DEFINE_string("data", None, "cifar10.npz from peer_benchmark.")
flags.DEFINE_string("work_dir", None, "A local directory for the loader's files.")
flags.DEFINE_integer("seed", 0, "torch.manual_seed before the run.")
flags.DEFINE_float("epochs", ab94.hyp["opt"]["train_epochs"], "Training epochs.")
flags.DEFINE_string("widths", "64:256:256", "The three groups' widths.")
flags.DEFINE_integer("threads", 2, "torch.set_num_threads.")
flags.DEFINE_integer("profile_steps", 0, "Instead of a run: profile this many steps.")
flags.mark_flags_as_required(["data", "work_dir"])


def main(argv: list[str]) -> None:
    args = FLAGS  # (the peer's own process: no TensorFlow, so no trainer.cli)
    torch.set_num_threads(args.threads)  # change 4
    torch.cuda.Event = _WallClockEvent  # change 3
    torch.cuda.synchronize = lambda *a, **k: None
    loader_dir = os.path.join(args.work_dir, "cifar10")
    os.makedirs(loader_dir, exist_ok=True)
    write_loader_files(args.data, loader_dir)
    os.chdir(args.work_dir)  # train() opens its test loader at 'cifar10'

    class CpuCifarLoader(ab_utils.CifarLoader):  # change 2: gpu='cpu'
        def __init__(self, path, *a, **kw):
            kw.setdefault("gpu", "cpu")
            super().__init__(path, *a, **kw)

    ab_utils.CifarLoader = CpuCifarLoader
    blocks = [int(w) for w in args.widths.split(":")]
    widths = dict(block1=blocks[0], block2=blocks[1], block3=blocks[2])
    train_loader = CpuCifarLoader("cifar10", train=True,
                                  batch_size=ab94.hyp["opt"]["batch_size"],
                                  aug=ab94.hyp["aug"], altflip=True)
    if args.profile_steps:
        profile(args, widths, train_loader)
        return

    rows = []  # what airbench's table prints, row by row
    print_row = ab_utils.print_training_details

    def recorded(variables, is_final_entry):
        rows.append({key: variables.get(key) for key in (
            "epoch", "train_loss", "train_acc", "val_acc", "tta_val_acc",
            "total_time_seconds")})
        print_row(variables, is_final_entry)

    ab_utils.print_training_details = recorded
    torch.manual_seed(args.seed)  # change 6
    ab94.train94(train_loader, epochs=args.epochs, make_net=lambda: make_net(widths),
                 run=args.seed)
    # The last epoch's row: the whitening init and every training epoch, timed by
    # airbench; its final row adds the TTA evaluation, which ours does not count.
    train_seconds = rows[-2]["total_time_seconds"]
    steps = int(np.ceil(len(train_loader) * args.epochs))
    result = {"tta_accuracy": rows[-1]["tta_val_acc"], "val_accuracy": rows[-2]["val_acc"],
              "train_seconds": train_seconds, "steps": steps,
              "images_per_second": steps * train_loader.batch_size / train_seconds,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    print("PEER_RESULT " + json.dumps(result), flush=True)


def profile(args, widths: dict, train_loader) -> None:
    """--profile_steps: PyTorch's profiler over that many of airbench's training
    steps (after 5 warm-up steps), its op table by self CPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    torch.manual_seed(args.seed)
    model = make_net(widths)
    ab_utils.init_whitening_conv(model[0], train_loader.normalize(train_loader.images[:5000]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.85, nesterov=True)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    batches = iter(train_loader)

    def one_step():
        inputs, labels = next(batches)
        loss = loss_fn(model(inputs), labels).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(5):
        one_step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(args.profile_steps):
            one_step()
        seconds = (time.perf_counter() - started) / args.profile_steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    ops = [{"name": e.key, "self_cpu_seconds": e.self_cpu_time_total / 1e6 / args.profile_steps}
           for e in prof.key_averages()]
    print(table)
    print("PEER_PROFILE " + json.dumps({"step_seconds": seconds, "ops": ops}))


if __name__ == "__main__":
    app.run(main)

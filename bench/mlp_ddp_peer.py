#!/usr/bin/python3
"""PyTorch DDP (Gloo, CPU) peer of `dptrain launch RECIPE --json`: the recipe's MLP on N ranks.

Usage:
  /usr/bin/python3 bench/mlp_ddp_peer.py RECIPE --nproc N [--json]

It reads the same recipe file as dptrain, so both sides train the same model on the same kind of
data with the same optimizer, and it answers with the same JSON fields dptrain's launcher prints:
samples_per_s, world_size, steps, final_loss (plus warmup_steps, timed_s and versions).

The launcher mode spawns one process per rank itself (torchrun does not work under Debian's
Python 3.11) with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment; with --worker the
script is one rank and reads those variables, so it also runs under an external launcher.
"""

import sys

import benchlib

# Recipe defaults the peer relies on; they mirror core/recipe.hpp.
DEFAULTS = {
    "seed": 1,
    "model": {"type": "mlp", "input": 784, "hidden": [256, 256], "classes": 10,
              "activation": "relu"},
    "data": {"type": "synthetic-classification", "samples": 60000, "noise": 1.0,
             "eval_fraction": 0.1},
    "train": {"steps": 500, "batch_per_rank": 64, "grad_accum": 1, "precision": "fp32",
              "threads_per_rank": 1},
    "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9,
                  "nesterov": False, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                  "schedule": {"type": "cosine"}, "clip_grad_norm": 0.0},
    "distributed": {"sync": "allreduce", "compression": {"type": "none"}, "timeout_s": 300.0},
}


def supported(recipe):
    return [
        ("/model/type", recipe["model"]["type"], {"mlp"}),
        ("/model/activation", recipe["model"]["activation"], {"relu", "gelu"}),
        ("/data/type", recipe["data"]["type"], {"synthetic-classification"}),
        ("/train/grad_accum", recipe["train"]["grad_accum"], {1}),
        ("/train/precision", recipe["train"]["precision"], {"fp32"}),
        ("/optimizer/type", recipe["optimizer"]["type"], {"adamw", "sgd"}),
        ("/optimizer/schedule/type", recipe["optimizer"]["schedule"]["type"], {"constant"}),
        ("/distributed/sync", recipe["distributed"]["sync"], {"allreduce"}),
        ("/distributed/compression/type", recipe["distributed"]["compression"]["type"], {"none"}),
    ]


def load_recipe(path):
    return benchlib.load_peer_recipe(path, DEFAULTS, supported)


def make_dataset(recipe, torch):
    """Gaussian class clusters; all in memory so indexing is the only data cost."""
    data, model = recipe["data"], recipe["model"]
    gen = torch.Generator().manual_seed(int(recipe["seed"]))
    # Centres spread like dptrain's (core/data/dataset.cpp): ~3.5 noise units apart whatever the
    # feature count, so the task is as hard on both sides and the final losses are comparable.
    centres = torch.randn(model["classes"], model["input"], generator=gen)
    centres *= 3.5 / model["input"] ** 0.5
    labels = torch.randint(model["classes"], (data["samples"],), generator=gen)
    features = centres[labels] + data["noise"] * torch.randn(data["samples"], model["input"],
                                                             generator=gen)
    train_count = data["samples"] - round(data["samples"] * data["eval_fraction"])
    return features[:train_count].contiguous(), labels[:train_count].contiguous()


def make_model(recipe, nn):
    spec = recipe["model"]
    activation = nn.ReLU if spec["activation"] == "relu" else nn.GELU
    layers, width = [], spec["input"]
    for hidden in spec["hidden"]:
        layers += [nn.Linear(width, hidden), activation()]
        width = hidden
    layers.append(nn.Linear(width, spec["classes"]))
    return nn.Sequential(*layers)


def make_optimizer(recipe, params, torch):
    spec = recipe["optimizer"]
    # Weight decay on the weight matrices only, not the biases, as dptrain; each group sets it
    # (torch's AdamW default, 0.01, is not the recipe's, 0).
    groups = benchlib.decay_groups(params, spec["weight_decay"])
    if spec["type"] == "adamw":
        return torch.optim.AdamW(groups, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]),
                                 eps=spec["eps"])
    return torch.optim.SGD(groups, lr=spec["lr"], momentum=spec["momentum"],
                           nesterov=spec["nesterov"])


def run_rank(recipe):
    """One rank: trains, and rank 0 prints one JSON line with the global throughput."""
    torch, dist, rank, _ = benchlib.init_rank(recipe["train"]["threads_per_rank"],
                                              recipe["distributed"]["timeout_s"])
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(int(recipe["seed"]))  # the same initial weights on every rank
    features, labels = make_dataset(recipe, torch)
    model = DistributedDataParallel(make_model(recipe, nn))
    optimizer = make_optimizer(recipe, model.parameters(), torch)
    loss_fn = nn.CrossEntropyLoss()
    clip = float(recipe["optimizer"]["clip_grad_norm"])
    batch_gen = torch.Generator().manual_seed(int(recipe["seed"]) * 1000003 + rank)
    steps, batch = int(recipe["train"]["steps"]), int(recipe["train"]["batch_per_rank"])

    def step(_):
        index = torch.randint(features.shape[0], (batch,), generator=batch_gen)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(features[index]), labels[index])
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    loss, warmup, timed_s = benchlib.timed_loop(dist, steps, step)
    benchlib.finish_rank(torch, dist, loss, steps, warmup, batch, timed_s)


def summary(result):
    return (f"PyTorch DDP, {result['world_size']} rank(s): "
            f"{result['samples_per_s']:.0f} samples/s, final loss {result['final_loss']:.4f}")


if __name__ == "__main__":
    sys.exit(benchlib.peer_main("mlp_ddp_peer", __file__, __doc__, load_recipe, run_rank,
                                summary))

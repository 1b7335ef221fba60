"""The tiny model learning Python: training and held-out loss on bytes of the standard library's
sources, the run `tests/test_training.py::test_the_tiny_model_learns_python_source_text` makes,
drawn as docs/training_loss.png (needs matplotlib, which the library itself does not).

    python bench/learning_curve.py [--steps 120] [--out docs/training_loss.png]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                                                 "training_loss.png"))
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from test_training import learning_run

    train, held = [], []

    def log(step, loss, held_out):
        train.append((step, loss))
        if held_out is not None:
            held.append((step, held_out))
            print(f"step {step}: train {loss:.3f}, held-out {held_out:.3f}", flush=True)

    before, after = learning_run(steps=args.steps, log=log)
    held.insert(0, (0, before))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="training batch (1,024 bytes)", lw=1, alpha=0.7)
    ax.plot(*zip(*held), "o-", label="held-out files (8,192 bytes)")
    ax.axhline(6.931, ls=":", c="gray", label="uniform over 1,024 tokens")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy, nats per byte")
    ax.set_title("tiny gpt-oss (4 layers, 8 experts) on the Python standard library's sources")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"held-out loss {before:.3f} -> {after:.3f}; wrote {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()

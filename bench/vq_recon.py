"""Measure a trained VQ image tokenizer (a ``vq`` run's checkpoint) on its held-out images.

Prints, over every validation image of the codec's own recipe data (mnist5k: the 500 held-out digits):
reconstruction MSE (per pixel, [0, 1] scale) and PSNR (mean over images of 10·log10(1 / MSE), dB) of
``decode(encode(x))``; codebook usage (fraction of the K codes the held-out set uses) and perplexity
(exp of the entropy of their frequencies); with ``--classifier`` (a trained image classifier, e.g. the
quickstart ``vit_tiny_classify_mnist5k`` run) its accuracy on the real images and on their
reconstructions, the same images, reconstructions rounded to uint8 pixels as an image file would hold.

    python bench/vq_recon.py runs/vq_mnist5k/<id>/checkpoints/last.ckpt \
        --classifier runs/vit_tiny_classify_mnist5k/<id>/checkpoints/last.ckpt [--out recon.png]
"""

from __future__ import annotations

import argparse
import time

import torch
from torchvision.utils import make_grid, save_image

from mmformer.build import build_datamodule
from mmformer.build import load_checkpoint as load_training_checkpoint
from mmformer.evaluation import ClassifierFeatures, load_checkpoint
from mmformer.tasks.diffusion import to_uint8
from mmformer.tokenizers.vq import code_perplexity, load_vq, to_unit_range


def held_out(path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The validation images (uint8 ``(N, C, H, W)``) and labels (``(N,)`` or None) of the data the
    ``vq`` run at ``path`` was trained on."""
    checkpoint = load_training_checkpoint(path)
    name = checkpoint.task("vq")
    datamodule = build_datamodule(checkpoint.recipe, checkpoint.context)
    datamodule.setup("validate")
    data = datamodule.data[name].val
    items = [data[i] for i in range(len(data))]
    labels = torch.tensor([it["label"] for it in items]) if "label" in items[0] else None
    return torch.stack([it["image"] for it in items]), labels


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a vq run's .ckpt")
    parser.add_argument("--classifier", help="a classification run's .ckpt (scores real vs reconstructed)")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--out", help="write the first 16 originals above their reconstructions here (PNG)")
    args = parser.parse_args()

    vq = load_vq(args.checkpoint)
    images, labels = held_out(args.checkpoint)
    start = time.perf_counter()
    recon = torch.cat(
        [
            vq.decode(vq.encode(images[i : i + args.batch_size]))
            for i in range(0, len(images), args.batch_size)
        ]
    )
    ids = torch.cat(
        [vq.encode(images[i : i + args.batch_size]) for i in range(0, len(images), args.batch_size)]
    )
    seconds = time.perf_counter() - start
    x = to_unit_range(images)
    per_image = ((recon - x) / 2).pow(2).flatten(1).mean(1)  # [0, 1] scale
    counts = torch.bincount(ids.flatten(), minlength=vq.codebook_size)
    print(
        f"held-out images: {len(images)} ({tuple(images.shape[1:])}), codes per image {vq.num_codes} {vq.grid}"
    )
    print(f"reconstruction MSE ([0,1] scale): {per_image.mean():.5f}")
    print(
        f"PSNR (mean over images):          {(-10 * torch.log10(per_image.clamp_min(1e-10))).mean():.2f} dB"
    )
    print(f"codebook usage: {int((counts > 0).sum())}/{vq.codebook_size} = {(counts > 0).float().mean():.3f}")
    print(f"code perplexity: {code_perplexity(counts):.1f} (of {vq.codebook_size})")
    print(f"encode+decode twice: {seconds:.2f} s ({len(images) / seconds * 2:.0f} images/s one way each)")
    if args.out:
        grid = make_grid((torch.cat([x[:16], recon[:16]]) + 1) / 2, nrow=16, padding=1)
        save_image(grid, args.out)
        print(f"wrote {args.out}")
    if args.classifier:
        if labels is None:
            raise SystemExit("--classifier needs labelled held-out images (an image folder)")
        loaded, name = load_checkpoint(args.classifier, "classification")
        classifier = ClassifierFeatures(loaded, name).eval()
        for what, batch in (("real", images), ("reconstructed", to_uint8(recon))):
            pred = torch.cat(
                [
                    classifier.logits(batch[i : i + args.batch_size]).argmax(-1)
                    for i in range(0, len(batch), args.batch_size)
                ]
            )
            print(f"classifier accuracy on {what} images: {(pred == labels).float().mean():.4f}")


if __name__ == "__main__":
    main()

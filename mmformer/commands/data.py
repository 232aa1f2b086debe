"""``mmformer data list | prepare NAME | shard SRC --out DIR``: the bundled datasets and WebDataset shards."""

from __future__ import annotations

from ..data.caption_shards import CAPTION_MODALITIES, shard_captions
from ..data.packed_shards import shard_text
from ..data.prepare import BUNDLED, prepare
from ..data.roots import data_root, resolve_root
from ..data.shards import shard_folder
from ..errors import UsageError
from ..tokenizers.text import TextTokenizer


def cmd_data(args) -> int:

    if args.action == "list":
        width = max(len(n) for n in BUNDLED)
        for name, b in BUNDLED.items():
            state = "prepared" if b.is_prepared(data_root() / name) else "not prepared"
            print(f"{name:{width}s} {state:13s} {b.description}")
        return 0
    if args.action == "shard":
        return _shard(args)
    if not args.name:
        raise SystemExit("usage: mmformer data prepare NAME  (see: mmformer data list)")
    prepare(args.name, force=args.force)  # logs where the dataset is
    return 0


def _shard(args) -> int:

    if not args.name or args.out is None:
        modalities = "image|audio|text|image_caption|audio_caption"
        raise UsageError(f"usage: mmformer data shard SOURCE --out DIR --modality {modalities}")
    if args.tokenizer is not None and args.modality != "text":
        raise UsageError("--tokenizer counts the tokens of text shards (--modality text) for packing")
    src = resolve_root(args.name)
    if args.modality == "text":
        tokenizer = None
        if args.tokenizer is not None:
            tokenizer = TextTokenizer.from_file(args.tokenizer)
        info = shard_text(src, args.out, args.val_fraction, args.seed, args.samples_per_shard, tokenizer)
    elif args.modality in CAPTION_MODALITIES:
        info = shard_captions(src, args.out, args.modality, args.text_key, args.samples_per_shard)
    else:
        info = shard_folder(src, args.out, args.modality, args.samples_per_shard)
    for split, shards in info["splits"].items():
        print(f"{split}: {sum(n for _, n in shards)} samples in {len(shards)} shards")
    print(f"wrote {args.out}/index.json; read it with data: {{kind: shards, root: {args.out}}}")
    return 0

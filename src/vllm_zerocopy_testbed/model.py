"""A tiny deterministic Llama and its locally trained tokenizer, with no hub access.

Same bytes on every run: weights come from our own seeded generator in sorted
parameter order (not from transformers' initialisers, which may change between
releases), the tokenizer is a byte-level BPE trained on a fixed corpus. The
checksum over all files is printed so two machines can compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SEED = 20_261_129
# Where the host keeps the model (the node image builds its own copy at /model).
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "model" / "tiny-llama"
_MARKER = "testbed-model.json"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; head_dim 32 because vLLM's CPU attention rejects 16."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    # Room for prompt_embeds past the MessageQueue chunk (2 MiB = 4096 fp32 rows of 128)
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# The shm tensor arena's variant (tests/e2e/test_arena.py): 2048 prompt_embeds rows of 1024 fp32 are 8 MiB,
# the arena's lower limit, within max-model-len; two layers keep a 2048-token prefill to seconds on one core.
ARENA_SPEC = TinyModelSpec(hidden_size=1024, num_layers=2, num_heads=32, num_kv_heads=8, intermediate_size=1024,
                           max_positions=4096)

# The structured-output variant (/model-vocab256k in the node image): a grammar bitmask row is
# vocab / 8 bytes, so 32 structured requests in one batch make a >= 1 MiB out-of-band buffer.
LARGE_VOCAB = 262144

# The models the node image builds (images/node/Dockerfile), by the path TESTBED_MODEL names there: a
# server on this host (the reference, the local backend) builds and serves the same variant.
IMAGE_MODELS = {"/model": TinyModelSpec(), "/model-vocab256k": TinyModelSpec(vocab_size=LARGE_VOCAB)}


def spec_for(image_path: str) -> TinyModelSpec:
    """The variant the node image serves at ``image_path`` (``TESTBED_MODEL``); the default model for
    a path the image does not build (a host server then serves what it always did)."""
    return IMAGE_MODELS.get(image_path.rstrip("/") or "/", TinyModelSpec())

_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallel stages pass hidden states from one node to the next.",
    "Tensor parallel ranks all-reduce partial sums after every layer.",
    "A message queue broadcasts the scheduler output to every worker.",
    "Zero copy means the bytes are not copied into the pickle stream.",
    "Ray compiled graphs move outputs through shared memory channels.",
    "Logprobs tell how likely each token was under the model.",
    "Prompt embeddings skip the token lookup and feed vectors directly.",
    "Every request has a timeout, and every wait has a bound.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main():\n    return 0\n",
)


def _corpus() -> list[str]:
    # Repetition with numbering gives the BPE trainer stable pair counts.
    return [f"{i} {line}" for i in range(40) for line in _CORPUS_LINES]


def build_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    """Train a byte-level BPE tokenizer of ``spec.vocab_size`` entries into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)


def build_weights(spec: TinyModelSpec, out: Path) -> None:
    """Write config and seeded fp32 weights of a Llama of ``spec``'s shape into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED)
    state = {}
    for name, param in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(param.shape, dtype=torch.float32)
        else:
            state[name] = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.08
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)


def model_dir(spec: TinyModelSpec) -> Path:
    """Where the host keeps ``spec``'s build: ``DEFAULT_DIR`` for the default, a sibling per variant."""
    default = TinyModelSpec()
    if spec == default:
        return DEFAULT_DIR
    shape = "" if (spec.hidden_size, spec.num_layers) == (default.hidden_size, default.num_layers) else \
        f"-h{spec.hidden_size}x{spec.num_layers}"
    return DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-vocab{spec.vocab_size}-pos{spec.max_positions}{shape}")


def checksum(directory: Path) -> str:
    """Return the sha256 over the names and bytes of every file in ``directory``."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != _MARKER):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(out: Path, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Build the model into ``out`` (skipped if already complete); return its checksum."""
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()).get("spec") == spec.__dict__:
        return json.loads(marker.read_text())["checksum"]
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(spec, out)
    build_weights(spec, out)
    digest = checksum(out)
    marker.write_text(json.dumps({"spec": spec.__dict__, "checksum": digest}, indent=1))
    return digest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the testbed's tiny deterministic Llama.")
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="directory to write")
    parser.add_argument("--max-positions", type=int, default=TinyModelSpec.max_positions)
    parser.add_argument("--vocab-size", type=int, default=TinyModelSpec.vocab_size,
                        help="the model's vocabulary; past what the corpus trains, ids have no token "
                             f"(structured outputs mask them): {LARGE_VOCAB} makes a grammar bitmask row 32 KiB")
    args = parser.parse_args(argv)
    digest = build(args.out, TinyModelSpec(max_positions=args.max_positions, vocab_size=args.vocab_size))
    print(f"{args.out} sha256={digest}")


if __name__ == "__main__":
    main()

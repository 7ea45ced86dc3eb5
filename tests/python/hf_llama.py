"""Hugging Face's side of dtrain's safetensors tests (tools/gpt/hf_export_test.cpp and
tests/checkpoint/safetensors_test.cpp), on the project environment's transformers and safetensors.

  hf_llama.py compare DIR LOGITS [DIR LOGITS ...] [--key logits_after]
      For each pair (several share one Python start): loads DIR (what train_gpt --export-hf
      wrote) with LlamaForCausalLM.from_pretrained, runs it on LOGITS' "tokens" and compares with
      LOGITS' logits (what dtrain computed). Prints one JSON line a pair: max_abs_diff, and the
      same for two wrong maps a reader could make - q/k rows permuted from Hugging Face's
      rotate-half layout to Meta's interleaved one, and gate/up swapped - which must be far off
      for the comparison to mean anything. Exits 1 when a max_abs_diff > --tolerance.
  hf_llama.py make DIR REFERENCE [--max-shard-size 100KB] [--seed 0] [--std 0.1]
      Builds a random small LlamaForCausalLM, save_pretrained(DIR, safe_serialization=True,
      max_shard_size=...) (sharded), and writes REFERENCE: "tokens" and the model's "logits" on
      them, for dtrain to import DIR and compare.
  hf_llama.py copy IN OUT [--keep-metadata] [--add-one TENSOR]
      safetensors.torch.load_file(IN), save_file to OUT: Python reading and writing every dtype;
      with --keep-metadata, IN's __metadata__ written again (safe_open(IN).metadata()), as a
      script that edits a file and keeps its metadata does; --add-one TENSOR adds 1 to that one.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def logits_of(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def permute_to_interleaved(weight, heads):
    """Meta's layout from Hugging Face's: within each head, rows [0..d/2) and [d/2..d) interleave.
    (The inverse of the permute in transformers' convert_llama_weights_to_hf.py.) A map that
    applied it, or forgot to undo it, would load these rows."""
    rows, width = weight.shape
    d = rows // heads
    return weight.view(heads, 2, d // 2, width).transpose(1, 2).reshape(rows, width)


def compare(args):
    if len(args.pairs) % 2 != 0:
        sys.exit(f"hf_llama.py compare: expected pairs of DIR LOGITS, got {args.pairs}")
    worst = 0.0
    for i in range(0, len(args.pairs), 2):
        result = compare_one(args.pairs[i], args.pairs[i + 1], args.key)
        result["tolerance"] = args.tolerance
        print(json.dumps(result), flush=True)
        worst = max(worst, result["max_abs_diff"])
    return 0 if worst <= args.tolerance else 1


def compare_one(model_dir, logits_file, key):
    from transformers import LlamaForCausalLM

    expected = load_file(logits_file)
    tokens = expected["tokens"].long()
    want = expected[key].float()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    got = logits_of(model, tokens)
    result = {"dir": model_dir, "max_abs_diff": (got - want).abs().max().item()}
    result["max_abs_logit"] = want.abs().max().item()

    # The wrong maps, for scale.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        for proj, h in heads.items():
            if name.endswith(f"self_attn.{proj}.weight"):
                tensor.copy_(permute_to_interleaved(tensor, h))
    result["max_abs_diff_permuted_qk"] = (logits_of(model, tokens) - want).abs().max().item()
    model.load_state_dict(state)
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.gate_proj.weight"):
            up = state[name.replace("gate_proj", "up_proj")]
            tensor.copy_(up)
            model.state_dict()[name.replace("gate_proj", "up_proj")].copy_(state[name])
    result["max_abs_diff_swapped_gate_up"] = (logits_of(model, tokens) - want).abs().max().item()
    return result


def make(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Larger weights than the default initialisation (std 0.02), so that attention is far from
    # uniform and rotary positions matter to the logits.
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                tensor.uniform_(0.5, 1.5)
            else:
                tensor.normal_(0.0, args.std)
    model.save_pretrained(args.dir, safe_serialization=True, max_shard_size=args.max_shard_size)
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, 256, (2, 40), generator=generator)
    save_file({"tokens": tokens, "logits": logits_of(model, tokens).contiguous()}, args.reference)
    shards = sorted(f for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    print(json.dumps({"shards": len(shards)}))
    return 0


def copy(args):
    from safetensors import safe_open

    tensors = load_file(args.input)
    if args.add_one:
        tensors[args.add_one] += 1
    metadata = None
    if args.keep_metadata:
        with safe_open(args.input, framework="pt") as f:
            metadata = f.metadata()
    save_file(tensors, args.output, metadata=metadata)
    return 0


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("compare")
    p.add_argument("pairs", nargs="+", metavar="DIR LOGITS")
    p.add_argument("--key", default="logits_after")
    # float32 logits of a few units, computed in another order (sdpa vs dtrain's kernels): about
    # 1e-6 apart; a wrong map is off by 1e-1 or more.
    p.add_argument("--tolerance", type=float, default=1e-4)
    p = commands.add_parser("make")
    p.add_argument("dir")
    p.add_argument("reference")
    p.add_argument("--max-shard-size", default="100KB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.1, help="the weights' standard deviation")
    p = commands.add_parser("copy")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--keep-metadata", action="store_true")
    p.add_argument("--add-one", metavar="TENSOR")
    args = parser.parse_args()
    return {"compare": compare, "make": make, "copy": copy}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

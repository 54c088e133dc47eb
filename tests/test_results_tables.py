"""scripts/results_tables.py on a block-causal model: what the model refuses is a row saying why, not a crash."""
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import results_tables  # noqa: E402


def test_tables_of_a_block_causal_model_say_what_it_refuses(tmp_path):
    args = Namespace(model="tiny-sdar", output=str(tmp_path), gen_length=8, block_length=None, batch_size=2, limit=2,
                     only="caches")
    table = results_tables.tables(args).splitlines()
    assert "Caches on tiny-sdar (threshold 0.9, gen 8, block 4):" in table
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table if line.startswith("| ")}
    assert "refused: cache 'dkv' chooses rows for full attention" in rows["dkv"]
    assert rows["block"].split(" | ")[1].replace(".", "").isdigit()  # an accuracy: the block cache ran


def test_the_quantized_table_compares_each_scheme_with_float32(tmp_path):
    args = Namespace(model="tiny-llada", output=str(tmp_path), gen_length=32, block_length=None, batch_size=4, limit=4,
                     only="quantized")
    rows = [line.split(" | ") for line in results_tables.tables(args).splitlines() if line.startswith("| ")][1:]
    assert [row[0].removeprefix("| ") for row in rows] == ["float32", "int8", "int8-dynamic", "bfloat16", "int4"]
    assert rows[0][-3] == "100.0"  # float32's answers equal themselves
    weight_mb = [float(row[-2]) for row in rows]
    assert weight_mb[4] < weight_mb[1] < weight_mb[3] < weight_mb[0]  # int4 < int8 < bfloat16 < float32


def test_the_samplers_table_has_every_registered_sampler_or_why_not(tmp_path):
    """Every sampler of the registry is a row: with the dual cache where it takes it, else none, else the one-line
    reason the model refuses it; each point is drawn when matplotlib is there."""
    from dllm.samplers import SAMPLERS

    args = Namespace(model="tiny-llada", output=str(tmp_path), gen_length=32, block_length=None, batch_size=2, limit=2,
                     only="samplers", cache="dual", plot=str(tmp_path / "samplers.png"))
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ") for line in
            results_tables.tables(args).splitlines() if line.startswith("| ") and not line.startswith("| sampler")}
    assert list(rows) == [cls.name for cls in SAMPLERS]
    assert rows["entropy_bound"][1].startswith("refused: sampler 'entropy_bound' cannot decode llada")
    assert rows["threshold"][1] == "dual" and float(rows["threshold"][-3]) > 1  # tokens per forward
    drawn = (tmp_path / "samplers.png").exists()
    assert drawn or "matplotlib is missing" in results_tables.tables(args)

"""The cuBLASLt algorithm table (andrea/engines/cublas.py): which table a GPU reads, which algorithm a product
takes, and that the committed table agrees with its own measurements."""

import json

import pytest

from andrea.engines.cublas import ALGORITHMS_FILE, algorithm_table, chosen_key, merged_tables, product_name

# a plan key as CublasLt._plan_for makes it: types, m, n, k, transposes, epilogue, FP8 accumulation (None: not
# FP8), algorithm, batch and strides, then the four alignments
GELU_AUX = ("bfloat16", "bfloat16", "bfloat16", 16384, 1536, 384, False, False, "gelu_aux", None, None, (1, 0, 0, 0),
            256, 256, 256, 256)


def _with(key, epilogue):
    return (*key[:8], epilogue, *key[9:])


def test_a_gpu_reads_only_the_table_made_on_it():
    tables = [{"device": "NVIDIA H200", "cublaslt": 120900, "choices": {"p": 3}},
              {"device": "NVIDIA H100", "cublaslt": 120900, "choices": {"p": 1}}]
    assert algorithm_table(tables, "NVIDIA H200", 120900) == {"p": 3}
    assert algorithm_table(tables, "NVIDIA H100", 120900) == {"p": 1}
    assert algorithm_table(tables, "NVIDIA H200", 120800) == {}  # another cuBLASLt: its heuristic's list may differ


def test_a_product_takes_the_table_s_algorithm_unless_one_is_asked_for():
    choices = {product_name(GELU_AUX): 4}
    assert chosen_key(GELU_AUX, None, choices)[10] == 4
    assert chosen_key(GELU_AUX, 0, choices)[10] == 0  # an explicit index is that index (the tuner's sweep)
    assert chosen_key(GELU_AUX, 2, choices)[10] == 2
    assert chosen_key(_with(GELU_AUX, "gelu"), None, choices)[10] == 4  # runs on gelu_aux's algorithm
    assert chosen_key(_with(GELU_AUX, "dgelu"), None, choices)[10] == 0  # not in the table: the heuristic's first
    other = (*GELU_AUX[:3], 8192, *GELU_AUX[4:])
    assert chosen_key(other, None, choices)[10] == 0
    assert product_name(chosen_key(GELU_AUX, None, choices)) == product_name(GELU_AUX)


def test_new_measurements_replace_their_products_and_keep_the_others():
    h200 = {"device": "NVIDIA H200", "cublaslt": 1, "margin": 0.03, "choices": {"a": 2, "b": 1},
            "measured_ms": {"a": [1.0, 0.9, 0.5], "b": [1.0, 0.5], "c": [1.0, 0.99]}}
    h100 = {"device": "NVIDIA H100", "cublaslt": 1, "margin": 0.03, "choices": {"a": 1}, "measured_ms": {"a": [1, 0.5]}}
    tables = merged_tables([h100, h200], "NVIDIA H200", 1, 0.03, {"c": 1}, {"b": [1.0, 0.99], "c": [1.0, 0.5]})
    assert tables[0] == h100
    assert tables[1]["choices"] == {"a": 2, "c": 1}  # b measured again without a faster one: no choice now
    assert tables[1]["measured_ms"] == {"a": [1.0, 0.9, 0.5], "b": [1.0, 0.99], "c": [1.0, 0.5]}
    again = merged_tables(tables, "NVIDIA H200", 1, 0.1, {}, {"c": [1.0, 0.95]})  # another margin: a new table
    assert again[1] == {"device": "NVIDIA H200", "cublaslt": 1, "margin": 0.1, "choices": {},
                        "measured_ms": {"c": [1.0, 0.95]}}
    assert merged_tables([], "NVIDIA H200", 2, 0.03, {"a": 1}, {"a": [1, 0.5]})[0]["choices"] == {"a": 1}


def test_the_committed_table_chooses_what_it_measured():
    if not ALGORITHMS_FILE.is_file():
        pytest.skip("no algorithm table committed")
    for table in json.loads(ALGORITHMS_FILE.read_text())["tables"]:
        assert {"device", "cublaslt", "margin", "choices", "measured_ms"} <= table.keys()
        for name, index in table["choices"].items():
            times = table["measured_ms"][name]
            assert index == min(range(len(times)), key=times.__getitem__), name
            assert times[index] < (1 - table["margin"]) * times[0], name
        for name, times in table["measured_ms"].items():
            if name not in table["choices"] and times:
                assert min(times) >= (1 - table["margin"]) * times[0], name

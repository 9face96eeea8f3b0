"""custom_dataset of the shipped lm-eval tasks: a JSON-lines file beside this one, found
from here rather than from the working directory (lm-eval's data_files are relative to it)."""
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(data_file: str, **_metadata) -> datasets.DatasetDict:
    """{"test": the rows of HERE/data_file}; other keys (lm-eval's metadata) are ignored."""
    return datasets.load_dataset("json", data_files={"test": str(HERE / data_file)})

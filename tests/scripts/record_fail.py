"""Rank FAIL_RANK raises inside a function decorated with torch's own @record; others wait."""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == os.environ.get("FAIL_RANK", "1"):
        time.sleep(0.5)
        raise ValueError("the answer is not 42")
    time.sleep(60)


if __name__ == "__main__":
    main()

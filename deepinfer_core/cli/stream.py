"""``StreamPrinter``: ``deepinfer generate``'s output written while it is generated (on a terminal, ``--stream``).

The layout is ``format_outputs``' (``cli/generate.py``), printed in prompt order: the first prompt's first
completion streams as its text arrives, and each completion that finishes closes with a line giving its finish
reason and token count; a later completion that was generated meanwhile is printed whole when its turn comes.
Interrupted, the terminal keeps what was printed: the text generated so far.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from deepinfer_core.cli.generate import RULE, completion_label, prompt_lines


class StreamPrinter:
    """Prints ``LLM.stream``'s snapshots (one ``RequestOutput`` per prompt, in order) as they grow."""

    def __init__(self, prompts: Sequence[str] | None, out: TextIO | None = None):
        self.prompts = prompts
        self.out = out if out is not None else sys.stdout
        self.block = 0  # the prompt being printed
        self.completion = 0  # its completion being printed
        self.printed = 0  # characters of that completion's text printed
        self.headed = False  # the prompt's header is printed
        self.opened = False  # the completion's label is printed

    def update(self, outputs: Sequence) -> None:
        """Print what ``outputs`` (the latest snapshot) adds to what is on the screen."""
        while self.block < len(outputs):
            output = outputs[self.block]
            if not self.headed:
                shown = self.prompts[self.block] if self.prompts is not None else None
                self._write("\n".join(prompt_lines(self.block, len(outputs), output, shown)) + "\n")
                self.headed = True
            if not self._print_completions(output):
                break
            self.block, self.completion, self.headed = self.block + 1, 0, False
        self.out.flush()

    def close(self) -> None:
        """The closing rule, once every prompt is printed."""
        self._write(f"{RULE}\n")
        self.out.flush()

    def interrupted(self) -> None:
        """End the line a completion was streaming on, so the next message starts on its own line."""
        if self.printed:
            self._write("\n")
        self.out.flush()

    def _print_completions(self, output) -> bool:
        """Print the current prompt's completions from the cursor on; True when all of them are printed."""
        while self.completion < len(output.outputs):
            completion = output.outputs[self.completion]
            if not self.opened:
                self._write(f"--- {completion_label(completion, len(output.outputs))}:\n")
                self.opened = True
            self._write(completion.text[self.printed:])
            self.printed = len(completion.text)
            if completion.finish_reason is None:
                return False
            self._write(f"\n--- finish: {completion.finish_reason}, {len(completion.token_ids)} tokens\n")
            self.completion, self.printed, self.opened = self.completion + 1, 0, False
        return True

    def _write(self, text: str) -> None:
        self.out.write(text)

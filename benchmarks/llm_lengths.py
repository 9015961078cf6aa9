"""Published request-length distributions for the generative router benchmark.

Source: the Azure LLM inference trace 2023 (Azure/AzurePublicDataset, files
data/AzureLLMInferenceTrace_conv.csv and data/AzureLLMInferenceTrace_code.csv: the prompt
("ContextTokens") and output ("GeneratedTokens") token counts of every request to two Azure LLM
inference services over an hour on 2023-11-16), described in Patel et al., "Splitwise:
Efficient generative LLM inference using phase splitting", ISCA 2024. Licence: CC-BY 4.0
(attribution: that paper); what is here is a summary of it, not the trace: the joint histogram
of (prompt, output) tokens over the bins below, counted with numpy.histogram2d from the two
files. A request is drawn as a bin (weighted by its count) and a length uniform within it,
which keeps the trace's means within 2% and its correlation (long prompts in conversations
come with short answers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROMPT_EDGES = (1, 64, 128, 256, 512, 768, 1024, 1280, 1536, 2048, 3072, 4000, 4150, 8192, 16384)
OUTPUT_EDGES = (1, 16, 32, 64, 128, 192, 256, 384, 448, 512, 640, 1001)


@dataclass(frozen=True)
class LengthHistogram:
    name: str
    source: str
    prompt_edges: tuple[int, ...]
    output_edges: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]  # [prompt bin][output bin]

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) token counts."""
        h = np.asarray(self.counts, dtype=float)
        w = h.ravel() / h.sum()
        idx = rng.choice(len(w), n, p=w)
        i, j = np.divmod(idx, h.shape[1])
        pe, oe = np.asarray(self.prompt_edges), np.asarray(self.output_edges)
        prompt = np.floor(rng.uniform(pe[i], pe[i + 1])).astype(int)
        output = np.floor(rng.uniform(oe[j], oe[j + 1])).astype(int)
        return prompt, np.maximum(1, output)

    def means(self, n: int = 100_000, seed: int = 0) -> tuple[float, float]:
        p, o = self.sample(n, np.random.default_rng(seed))
        return float(p.mean()), float(o.mean())


AZURE_CONV_2023 = LengthHistogram(
    "azure-conv-2023",
    "Azure LLM inference trace 2023, conversation "
    "(AzureLLMInferenceTrace_conv.csv: 19366 requests; mean prompt 1155, output 211 tokens; "
    "median 1020 / 129)",
    PROMPT_EDGES, OUTPUT_EDGES, (
        (0, 0, 8, 81, 187, 25, 1, 0, 0, 0, 0),
        (85, 53, 4, 23, 37, 25, 0, 0, 0, 0, 0),
        (91, 0, 96, 564, 817, 464, 32, 1, 0, 1, 6),
        (2, 164, 384, 3948, 507, 21, 10, 3, 0, 1, 1),
        (2, 5, 35, 117, 14, 0, 1, 0, 0, 0, 1),
        (0, 7, 87, 348, 43, 1, 146, 1138, 104, 97, 7),
        (0, 5, 128, 212, 33, 0, 471, 3587, 355, 344, 84),
        (0, 2, 87, 224, 425, 230, 36, 55, 10, 14, 3),
        (0, 5, 141, 357, 58, 1, 0, 0, 1, 0, 0),
        (1, 14, 192, 505, 168, 14, 5, 0, 0, 0, 0),
        (0, 1, 38, 97, 48, 5, 0, 0, 0, 0, 0),
        (0, 123, 840, 371, 72, 18, 8, 1, 3, 1, 3),
        (0, 3, 41, 103, 25, 1, 0, 0, 1, 0, 0),
        (0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0)))

AZURE_CODE_2023 = LengthHistogram(
    "azure-code-2023",
    "Azure LLM inference trace 2023, coding "
    "(AzureLLMInferenceTrace_code.csv: 8819 requests; mean prompt 2048, output 28 tokens; "
    "median 1469 / 13)",
    PROMPT_EDGES, OUTPUT_EDGES, (
        (210, 93, 38, 19, 3, 3, 1, 1, 0, 0, 1),
        (248, 111, 29, 16, 2, 0, 0, 1, 1, 0, 0),
        (386, 133, 62, 38, 6, 8, 2, 0, 0, 1, 1),
        (331, 162, 77, 40, 12, 5, 9, 0, 0, 0, 0),
        (326, 149, 61, 29, 13, 6, 1, 1, 0, 1, 0),
        (411, 163, 62, 42, 10, 3, 6, 1, 0, 1, 1),
        (420, 162, 62, 20, 10, 2, 3, 0, 0, 0, 0),
        (307, 114, 58, 32, 10, 3, 1, 0, 0, 0, 3),
        (554, 210, 107, 65, 8, 8, 8, 2, 0, 1, 1),
        (944, 270, 142, 64, 14, 12, 4, 1, 1, 2, 5),
        (343, 118, 40, 31, 9, 7, 3, 1, 1, 1, 3),
        (47, 22, 7, 2, 1, 1, 0, 0, 0, 0, 1),
        (724, 249, 136, 67, 20, 6, 5, 3, 0, 1, 1),
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)))

DISTRIBUTIONS = {d.name: d for d in (AZURE_CONV_2023, AZURE_CODE_2023)}


def fixed(prompt: int, output: int) -> LengthHistogram:
    """Every request ``prompt`` tokens in and ``output`` out (``--lengths fixed:P,O``)."""
    return LengthHistogram(f"fixed:{prompt},{output}", "fixed lengths", (prompt, prompt + 1),
                           (output, output + 1), ((1,),))

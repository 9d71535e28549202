"""Where a prefill chunk over a prompt's images may end: the image rules a step's token budget meets.

Two rules, as vLLM v1's encoder scheduling:

- **Whole images** where the model needs them (`SchedulerConfig.split_images` False, Gemma 3: an image's
  tokens attend both ways, so the last one's keys must be cached or in the same step): a chunk ends
  before an image it cannot hold whole (`ember.multimodal.inputs.chunk_end`). Otherwise (Qwen2.5-VL's
  causal image tokens) a chunk may end anywhere inside an image, and the runner takes the rows it
  computes from the image's tower output, pinned in its cache until the request has computed them all.
- **An encoder budget** (`max_num_encoder_input_tokens`, vLLM's name): the tokens of the images whose
  tower outputs a step must have. An image counts in the step that first computes one of its tokens
  since the request was admitted (a running request's chunk that starts inside an image counts none:
  that image's output stays pinned). The scheduler does not see the runner's content-hash cache, so an
  image counts even where the tower will find it cached: the budget bounds the step's tower work from
  above and only ever delays. An image longer than the whole budget is encoded alone, in a step whose
  budget nothing else has taken (vLLM raises its budget to the largest item instead, which needs every
  image's size up front; Qwen2.5-VL's follow each picture): it never waits forever.
"""

from __future__ import annotations

from ember.multimodal.inputs import ImageInput, chunk_end, images_in


class EncoderBudget:
    """One step's encoder budget, and the image rules for a chunk: `fit` plans a chunk, `take` commits it."""

    def __init__(self, limit: int, split_images: bool) -> None:
        self.limit = limit
        self.split_images = split_images
        self.left = limit

    def fit(self, images: list[ImageInput], start: int, n: int, token_budget: int, resumed: bool) -> tuple[int, int]:
        """How many of the n tokens from `start` a chunk may compute, and the encoder tokens it takes.
        `resumed`: a running request (an image started before `start` was encoded by an earlier step);
        `token_budget`: the step's tokens left, which a whole image reaching past `start + n` (a prefix-cache
        hit may end inside one) must fit. 0 tokens: the request waits for a later step."""
        if not images or start >= images[-1].end:  # text, or past the images: most steps
            return n, 0
        end = start + n
        if not self.split_images:
            end = chunk_end(images, start, end)
            if end - start > token_budget:
                return 0, 0
        cost = 0
        for image in images_in(images, start, end):
            if resumed and image.offset < start:
                continue
            alone = cost == 0 and self.left == self.limit  # nothing else encoded in this step
            if cost + image.length > self.left and not alone:
                return max(start, image.offset) - start, cost
            cost += image.length
        return end - start, cost

    def take(self, cost: int) -> None:
        self.left = max(0, self.left - cost)

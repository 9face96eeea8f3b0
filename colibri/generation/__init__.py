"""Generation: from a prompt to text, over the engine.

generate / batching / steps / stops (the loop, the scheduler, what a step yields, when to
stop), sampling (SamplingParams, Sampler: one set of rules), speculative /
speculative_batch / drafters, constraints / tool_calls (structured output), prefix_sharing
(the scheduler's use of the engine's prefix cache), prompt_logprobs / scoring. The tokenizer
and the chat template are the model file's (colibri.format.tokenizer, .chat_template).
"""

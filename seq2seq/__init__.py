"""What encoder-decoder models share (installed as `nndf.seq2seq`, never as a top-level package).

Three graphs per model, as in NVIDIA's demo, each a session with the same named-tensor call as the decoder-only
one: the encoder, the cross-attention cache generator (run once per sequence: the encoder's hidden states become
every decoder layer's cross-attention keys and values) and the decoder with its self-attention KV cache, which takes
those keys and values as inputs and never recomputes them. The generation loop is the decoder-only one: only how
its first state is prepared differs (`Seq2SeqDecoder.start`), chosen through `nndf.architectures`.

Image-to-text models (BLIP) are the same three graphs with a vision encoder swapped in (`image_graphs`: the graph
set; `captioning`: the strategy, its ShapeSpec and `CaptionDecoder`, whose text decoder starts from a prompt).
The graph set of a kind of model (`TextGraphs`, `ImageGraphs`) gives the graphs' names, wrappers and tracing
examples; export and every backend take them from there.
"""

"""What the trt backend would build, known without a GPU: each graph's profiles and its `trtexec` command.

`--info` prints this before the one-sentence refusal on a machine without a GPU (or without TensorRT), so that a
user can prepare a build there: the ONNX graphs can be exported on any machine (`run.py export ... onnxrt`), and
the commands name the files the export writes. Nothing here imports TensorRT or loads weights.
"""

from __future__ import annotations

from pathlib import Path

from nndf.architectures import architecture
from nndf.backends import BackendOptions
from nndf.loading import LoadedModel
from nndf.spec import BuildSettings


def engine_plan(loaded: LoadedModel, settings: BuildSettings, options: BackendOptions) -> list[dict]:
    """One entry per graph: its name, ONNX file, profiles and the trtexec command that builds its engine (named
    after the graph, since an engine's real name hashes the GPU it is built on); `pending` says what the command
    cannot name yet (an fp16 build's fp32 layers, read off a graph not exported yet)."""
    from nndf.backends.trt import USE_TF32, fp32_layer_nodes
    from nndf.export.engine_build import describe_profiles, trtexec_command
    from nndf.export.engine_request import EngineRequest

    strategy = architecture(loaded.spec)
    shapes = strategy.derive_shapes(settings, loaded.spec, loaded.config)
    if strategy.has_encoder:
        from nndf.seq2seq.export import seq2seq_export_location

        exports = seq2seq_export_location(loaded, settings.use_cache, options.working_dir).graphs
        profiles = {graph: shapes.graph_profiles(graph, export.input_names) for graph, export in exports.items()}
    else:
        from nndf.export.onnx import decoder_export_location

        exports = {"decoder": decoder_export_location(loaded, settings.use_cache, options.working_dir)}
        profiles = {"decoder": shapes.profiles(exports["decoder"].input_names)}
    plan = []
    for graph, export in exports.items():
        stem = f"{loaded.spec.family}-{loaded.name}-{graph}"
        # an fp16 build's fp32 layers are read off the exported graph: named when it is already exported
        exported = Path(export.graph).is_file()
        request = EngineRequest(stem=stem, graph=graph, onnx_path=export.graph, onnx_id=export.folder.name,
                                input_names=export.input_names, output_names=export.output_names,
                                profiles=profiles[graph], fp16=settings.fp16, tf32=USE_TF32,
                                preview_dynamic_shapes=settings.preview_dynamic_shapes, postfix=settings.engine_postfix,
                                fp32_layers=fp32_layer_nodes(loaded, settings, export.graph) if exported else ())
        engine = Path(options.working_dir) / f"{stem}{settings.engine_postfix}.engine"
        row = {"graph": graph, "onnx": str(export.graph), "profiles": describe_profiles(profiles[graph]),
               "trtexec": trtexec_command(request, engine)}
        if not exported and settings.fp16 and loaded.spec.hooks.fp32_modules():
            row["pending"] = (f"any layers of {', '.join(loaded.spec.hooks.fp32_modules())} in this graph stay fp32 in "
                              "the build; their names join the command once the graph is exported")
        plan.append(row)
    return plan

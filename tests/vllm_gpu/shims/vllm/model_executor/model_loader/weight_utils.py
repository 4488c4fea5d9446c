"""Stand-in for ``vllm.model_executor.model_loader.weight_utils`` (fused_layout imports it)."""


def composed_weight_loader(loader, fn):
    def composed(param, loaded_weight):
        loader(param, loaded_weight)
        param.data.copy_(fn(param))

    return composed

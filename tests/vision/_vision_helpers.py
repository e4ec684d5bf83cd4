"""Shared helpers for the vision-language tests."""


def square(colour, size=(56, 56)):
    """A plain-colour RGB PIL image."""
    from PIL import Image

    return Image.new("RGB", size, colour)


def likelihood_reward_model(src, dst):
    """A copy of the VLM directory ``src`` at ``dst`` marked as a ``likelihood`` reward model
    (the ``lightrft_reward`` block an export of recipes/reward_model.py writes): the untrained
    VLM scores a response by its own mean log-probability. Returns ``dst`` as a string."""
    import json
    import shutil

    from lightrft.models.reward import CONFIG_KEY, build_reward_net

    shutil.copytree(src, dst)
    block = build_reward_net(dst, pooling="likelihood").reward_config()
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, CONFIG_KEY: block}, indent=2))
    return str(dst)

"""A linear probe on a video model's frozen vision features: is the moving square's direction
in what the language model receives? (docs/vision.md, "Video", the motion runs.)

    python tests/benchmarks/video_probe.py MODEL_DIR MOTION_DATA_DIR [VIDEO_MAX_PIXELS]

MODEL_DIR: a tiny Qwen2-VL (configs/tiny/video_sft.yaml makes outputs/tiny/video_model);
MOTION_DATA_DIR: lightrft.tasks.ensure_motion_dataset's output. Fits a logistic regression on the
flattened merged features of 1,000 train videos and prints its accuracy on 200 test videos.
"""

import sys

import torch

from lightrft.data import MediaOptions, PromptDataset
from lightrft.data.video import VideoOptions
from lightrft.models.multimodal import load_processor, load_vision_model

NAMES = ["down", "left", "right", "up"]


def features(proc, model, path, n, max_pixels):
    video = VideoOptions(fps=4.0, max_pixels=max_pixels)
    ds = PromptDataset(proc, path, media=MediaOptions(video=video))
    xs, ys = [], []
    with torch.no_grad():
        for i in range(min(n, len(ds))):
            v = ds[i]["media"].video
            out = model.model.visual(v.pixel_values_videos, grid_thw=v.video_grid_thw)
            xs.append(out.pooler_output.reshape(-1))  # [tokens * hidden]
            ys.append(NAMES.index(ds[i]["reference"]))
    return torch.stack(xs), torch.tensor(ys)


def main() -> None:
    model_dir, data = sys.argv[1], sys.argv[2]
    max_pixels = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    proc, model = load_processor(model_dir), load_vision_model(model_dir)
    x_tr, y_tr = features(proc, model, f"{data}/train.jsonl", 1000, max_pixels)
    x_te, y_te = features(proc, model, f"{data}/test.jsonl", 200, max_pixels)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    w = torch.zeros(x_tr.shape[1], len(NAMES), requires_grad=True)
    b = torch.zeros(len(NAMES), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(x_tr @ w + b, y_tr) + 1e-3 * w.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def acc(x, y):
        return ((x @ w + b).argmax(-1) == y).float().mean().item()

    print(f"features {tuple(x_tr.shape)}: train {acc(x_tr, y_tr):.3f}, test {acc(x_te, y_te):.3f}")


if __name__ == "__main__":
    main()

"""A vision-language GenerativeReward: the judge sees each conversation's images through the
prompt datasets' own media path and the native engine, in both presentation orders, locally and
behind the reward server (images as PNG), with oversize and malformed images refused."""

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from lightrft.data import PromptDataset, SFTDataset
from lightrft.data.prompts import conversation
from lightrft.models.multimodal import load_processor
from lightrft.rewards import CombinedReward, GenerativeReward, RemoteReward, Sample
from lightrft.rewards.base import RewardInputError
from lightrft.rewards.generative import media_parts
from lightrft.rewards.remote import wire_conversation
from lightrft.rewards.server import decode_conversations, make_server
from lightrft.tasks.shapes import COLOURS, QUESTION, SHAPES_JUDGE_TEMPLATE, draw_board

VERDICTS = {"yes": 1.0, "no": 0.0}


@pytest.fixture(scope="module")
def boards(tmp_path_factory):
    """Two 3x3 boards as PNG files: 2 red squares, and 4 blue ones."""
    d = tmp_path_factory.mktemp("boards")
    paths = []
    for k, board in enumerate(
        [
            ("red", "red") + (None,) * 7,
            (None, "blue", "blue", None, "blue", "blue", None, None, None),
        ]
    ):
        assert all(c is None or c in COLOURS for c in board)
        path = d / f"b{k}.png"
        draw_board(board, 3, 28).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def vl(tiny_vlm):
    return str(tiny_vlm("qwen2_vl"))


def _chats(vl_dir, boards):
    """The conversations a GRPO run hands its rewards: PromptDataset items with their boards."""
    ds = PromptDataset(
        load_processor(vl_dir),
        records=[{"prompt": QUESTION, "images": [b], "answer": "2"} for b in boards],
    )
    return [ds[i]["prompt"] for i in range(len(ds))], [
        conversation(ds[i]["messages"], ds[i]["media"]) for i in range(len(ds))
    ]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_judge_prompt_is_the_judgment_datas_prompt(tiny_vlm, arch, boards):
    # The request the judge sends equals what the prompt datasets build from the judgment
    # record "<image>" + filled template (ids and pixels), and is the prompt part of the SFT
    # record the judge is trained on: judge and training data meet on the same tokens.
    vl = str(tiny_vlm(arch))
    judge = GenerativeReward(
        judge=vl, template=SHAPES_JUDGE_TEMPLATE, verdicts=VERDICTS, fallback=0.5, max_tokens=2
    )
    assert judge.media is not None  # it reads each sample's conversation
    _, chats = _chats(vl, boards[:1])
    text = SHAPES_JUDGE_TEMPLATE.format(prompt=QUESTION.replace("<image>", ""), response="2")
    (req,) = judge.media_requests([text], [media_parts(chats[0])])
    processor = load_processor(vl)
    record = {"prompt": "<image>" + text, "images": [boards[0]], "answer": "2"}
    want = PromptDataset(processor, records=[record])[0]
    assert req.prompt_token_ids == want["prompt_ids"]
    assert torch.equal(req.media.image.pixel_values, want["media"].image.pixel_values)
    assert torch.equal(req.media.image.image_grid_thw, want["media"].image.image_grid_thw)
    sft = SFTDataset(processor, records=[{**record, "completion": "yes"}])[0]["input_ids"]
    assert sft[: len(req.prompt_token_ids)].tolist() == req.prompt_token_ids
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert req.prompt_token_ids.count(image_id) == sum(req.media.image.num_tokens) > 0


def test_both_orders_with_images_and_counted_failures(vl, boards):
    prompts, chats = _chats(vl, boards)
    judge = GenerativeReward(judge=vl, mode="choice", both_orders=True, fallback=0.25, max_tokens=3)
    texts, media, jobs = judge.judge_prompts(
        Sample.batch(prompts, ["2", "4"], references=["3", "5"], conversations=chats)
    )
    # Two presentation orders per sample, each with that sample's board.
    assert jobs == [(0, True), (0, False), (1, True), (1, False)]
    assert "A: 2\nB: 3" in texts[0] and "A: 3\nB: 2" in texts[1]
    assert [p[0]["image"] for p in media] == [chats[0][0]["content"][0]["image"]] * 2 + [
        chats[1][0]["content"][0]["image"]
    ] * 2
    out = judge(Sample.batch(prompts, ["2", "4"], references=["3", "5"], conversations=chats))
    # Every reward is the mean of the two orders' parsed verdicts (fallback where unparsed),
    # recomputed here from the engine's own completions of the same requests.
    verdicts = judge._complete(texts, media)
    assert verdicts == judge.last_verdicts
    want = torch.zeros(2)
    fails = 0
    for (i, first), v in zip(jobs, verdicts, strict=True):
        got = judge._reward_of(v, first)
        fails += got is None
        want[i] += (0.25 if got is None else got) / 2
    assert torch.equal(out, want)
    assert judge.last_metrics["parse_failures"] == fails
    with pytest.raises(RewardInputError, match="give each sample its conversation"):
        judge(Sample.batch(prompts, ["2", "4"], references=["3", "5"]))
    # Through CombinedReward the recipe's conversations reach the judge.
    combined = CombinedReward({"judge": judge})(
        Sample.batch(prompts, ["2", "4"], references=["3", "5"], labels=None, conversations=chats)
    )
    assert torch.equal(combined.total, out)


def test_max_parse_failures_refuses_a_judge_that_never_matches(vl, boards):
    prompts, chats = _chats(vl, boards)
    judge = GenerativeReward(
        judge=vl,
        template=SHAPES_JUDGE_TEMPLATE,
        pattern=r"(VERDICT: never)",
        fallback=0.0,
        max_tokens=2,
        max_parse_failures=3,
    )
    judge(Sample.batch(prompts[:1], ["2"], conversations=chats[:1]))  # 1 failure in a row: allowed
    with pytest.raises(ValueError, match=r"last 3 verdicts did not match .*max_parse_failures"):
        judge(Sample.batch(prompts, ["2", "4"], conversations=chats))


def test_images_cross_the_wire_pixel_for_pixel(vl, boards):
    # PNG is lossless: the server's reward function reads exactly the actor's pixels.
    _, chats = _chats(vl, boards)
    wire = json.loads(json.dumps([wire_conversation(c, i) for i, c in enumerate(chats)]))
    assert wire[0][0]["content"][0]["image"].startswith("data:image/png;base64,")
    back = decode_conversations(wire, 2)
    for sent, got in zip(chats, back, strict=True):
        a, b = sent[0]["content"][0]["image"], got[0]["content"][0]["image"]
        assert a.size == b.size and a.tobytes() == b.tobytes()
        assert got[0]["content"][1] == sent[0]["content"][1]  # the question's text part
    assert decode_conversations(None, 2) is None


def test_remote_judge_with_images_equals_local(vl, boards):
    prompts, chats = _chats(vl, boards)
    # The default verdict pattern (a number): the random judge's verdicts are scored as written.
    kwargs = dict(judge=vl, template=SHAPES_JUDGE_TEMPLATE, fallback=-1.0, max_tokens=3)
    local = GenerativeReward(**kwargs)
    served = GenerativeReward(**kwargs)
    server = make_server(served, token="s3cret", max_image_pixels=100 * 100)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/judge"
    try:
        responses = ["2", "4", "4", "2"]
        want = local(Sample.batch(prompts * 2, responses, conversations=chats * 2))
        got = RemoteReward(url, token="s3cret", max_retries=0)(
            Sample.batch(prompts * 2, responses, conversations=chats * 2)
        )
        assert got == want.tolist()
        assert served.last_verdicts == local.last_verdicts and len(local.last_verdicts) == 4
        # Bad media is refused before any judging, naming where.
        judged = served.judged

        def post(body, token="s3cret"):
            req = urllib.request.Request(
                url, json.dumps(body).encode(), {"Authorization": f"Bearer {token}"}
            )
            try:
                urllib.request.urlopen(req, timeout=10)
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())["error"]
            return 200, ""

        big = draw_board((None,) * 25, 5, 28)  # 140x140 pixels, over 100x100
        chat = wire_conversation(
            [{"role": "user", "content": [{"type": "image", "image": big}]}], 0
        )
        code, err = post({"responses": ["2"], "conversations": [chat]})
        assert code == 413 and "140x140 = 19600 pixels" in err and "[0][0].content[0]" in err
        bad = [
            {"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"}]}
        ]
        code, err = post({"responses": ["2"], "conversations": [bad]})
        assert code == 400 and "not a PNG image" in err
        path = [{"role": "user", "content": [{"type": "image", "image": boards[0]}]}]
        code, err = post({"responses": ["2"], "conversations": [path]})
        assert code == 400 and "must be a string starting 'data:image/png;base64,'" in err
        assert post({"responses": ["2"], "conversations": [chat]}, token="wrong")[0] == 401
        assert served.judged == judged
    finally:
        server.shutdown()
        server.server_close()

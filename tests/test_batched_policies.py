"""data/batched_policies.py: torchvision's auto-augment policies on a whole uint8 batch, each image its own ops,
pinned image by image to torchvision's v2 kernels and to its classes' forward fed the same draws."""
import pytest
import torch
from torchvision.transforms import v2

from deepspeed_image_trainer.data.batched_policies import GEOMETRIC_OPS, BatchedPolicy

BILINEAR = v2.InterpolationMode.BILINEAR
# an odd, a square (rotate_image's rot90 fast path at 90 and 270 degrees) and a wide image size
SIZES = [(3, 24, 20), (3, 21, 21), (3, 15, 26)]
# one policy per op space: the three AutoAugment policies share theirs
SPACES = {"ra": {}, "ta_wide": {}, "imagenet": {}, "augmix": {"severity": 10}}


def reference_transform(policy, num_ops=2, magnitude=9, num_magnitude_bins=31, severity=3, mixture_width=3,
                        chain_depth=-1, alpha=1.0, all_ops=True, interpolation=v2.InterpolationMode.BILINEAR,
                        fill=None):
    """torchvision's transforms.v2 class for `policy` with these numbers: what BatchedPolicy reads, and the
    reference the tests compare with."""
    if policy == "ra":
        return v2.RandAugment(num_ops=num_ops, magnitude=magnitude, num_magnitude_bins=num_magnitude_bins,
                              interpolation=interpolation, fill=fill)
    if policy == "ta_wide":
        return v2.TrivialAugmentWide(num_magnitude_bins=num_magnitude_bins, interpolation=interpolation, fill=fill)
    if policy == "augmix":
        return v2.AugMix(severity=severity, mixture_width=mixture_width, chain_depth=chain_depth, alpha=alpha,
                         all_ops=all_ops, interpolation=interpolation, fill=fill)
    return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=interpolation, fill=fill)


def batched(policy, **numbers):
    return BatchedPolicy(reference_transform(policy, **numbers))


def images(count, size, seed=0):
    """Random pixels, with some grey ones (saturation's blend hits its rounding there) and a flat image
    (autocontrast's and equalize's degenerate case)."""
    batch = torch.randint(0, 256, (count, *size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    batch[:, 1, : size[1] // 3] = batch[:, 0, : size[1] // 3]
    batch[:, 2, : size[1] // 3] = batch[:, 0, : size[1] // 3]
    batch[-1] = 77
    return batch


def one_round(policy, ops, bins, negates):
    """Params giving image i op ops[i] with magnitude bin bins[i], negated where negates[i], in one round."""
    op = torch.tensor([policy.op_names.index(name) for name in ops]).unsqueeze(1)
    return {"op": op, "bin": torch.tensor(bins).unsqueeze(1), "negate": torch.tensor(negates).unsqueeze(1)}


def apply_round(policy, batch, params):
    """One round of policy's batched apply (AutoAugment's and AugMix's own apply need their full params)."""
    counts = torch.nn.functional.one_hot(params["op"], len(policy.op_names)).sum(0).tolist()
    tables = policy._tables_for(*batch.shape[-2:], batch.device)
    return policy._apply_rounds(batch, params, [0], counts, tables)


def torchvision_op(policy, image, name, bin, negate):
    """torchvision's _apply_image_or_video_transform for one image, its magnitude read from torchvision's op
    space as its forward reads it."""
    reference = policy.reference
    magnitudes = policy.space[name][0](policy.num_bins, *image.shape[-2:])
    magnitude = 0.0 if magnitudes is None else float(magnitudes[bin])
    magnitude *= -1 if negate else 1
    return reference._apply_image_or_video_transform(image, name, magnitude, interpolation=reference.interpolation,
                                                     fill=reference._fill)


def magnitude_bins(policy):
    """Every fourth bin, the second and the last (and TrivialAugmentWide's bin 20: Rotate's 90 degrees)."""
    count = policy.num_bins
    return sorted({*range(0, count, 4), 1, count - 1, *([20] if count > 20 else [])})


@pytest.mark.parametrize("name", list(SPACES))
def test_every_op_matches_torchvision_image_by_image(name):
    """Every op of each op space, at several magnitudes and both signs, mixed in one batch: each image is exactly
    torchvision's (colour and geometric ops alike: max difference 0 on every size tried)."""
    policy = batched(name, interpolation=BILINEAR, **SPACES[name])
    for size in SIZES:
        for op in policy.op_names[1:]:
            signs = (False, True) if policy.signed[policy.op_names.index(op)] else (False,)
            cases = [(bin, negate) for bin in magnitude_bins(policy) for negate in signs]
            batch = images(len(cases), size)
            bins, negates = zip(*cases)
            out = apply_round(policy, batch, one_round(policy, [op] * len(cases), list(bins), list(negates)))
            assert out.dtype == torch.uint8 and out.shape == batch.shape
            for i, (bin, negate) in enumerate(cases):
                expected = torchvision_op(policy, batch[i], op, bin, negate)
                assert torch.equal(out[i], expected), (op, size, bin, negate,
                                                       (out[i].int() - expected.int()).abs().max().item())


@pytest.mark.parametrize("fill, interpolation", [(0, BILINEAR), ([10, 200, 30], BILINEAR),
                                                 (None, v2.InterpolationMode.NEAREST), (7.0, "nearest")])
def test_geometric_ops_match_torchvision_with_its_fills_and_nearest(fill, interpolation):
    """fill 0 is not fill None in torchvision (its mask channel weights the border again): both, a fill per channel
    and nearest sampling give torchvision's pixels exactly."""
    policy = batched("ta_wide", interpolation=interpolation, fill=fill)
    cases = [(op, bin, negate) for op in GEOMETRIC_OPS for bin in (3, 20, 30) for negate in (False, True)]
    batch = images(len(cases), (3, 19, 23))
    out = apply_round(policy, batch, one_round(policy, *map(list, zip(*cases))))
    for i, case in enumerate(cases):
        assert torch.equal(out[i], torchvision_op(policy, batch[i], *case)), case


def assert_near(frequencies, probability, draws):
    """Observed frequencies within 6 standard deviations of a binomial's: loose, and the seed is fixed."""
    bound = 6 * (probability * (1 - probability) / draws) ** 0.5
    assert (torch.as_tensor(frequencies) - probability).abs().max() <= bound, (frequencies, probability, bound)


def test_draws_follow_torchvisions_distributions():
    """Ops uniform, magnitudes in range, signed ops negated half the time, AutoAugment's sub-policies uniform and
    their ops applied with their probabilities, AugMix's depths and ops uniform and its weights Dirichlet's."""
    generator = torch.Generator().manual_seed(0)
    count = 12000
    for name in ("ra", "ta_wide"):
        policy = batched(name, num_ops=2, magnitude=13)
        params = policy.draw(count, generator)
        assert params["op"].shape == (count, policy.num_rounds) and params["op"].device == generator.device
        draws = params["op"].numel()
        assert len(policy.op_names) == 14
        assert_near(torch.bincount(params["op"].flatten(), minlength=14) / draws, 1 / 14, draws)
        signed = policy.signed[params["op"]]
        assert not params["negate"][~signed].any()
        assert_near(params["negate"][signed].float().mean(), 0.5, signed.sum())
        if name == "ra":
            assert (params["bin"] == 13).all()
        else:
            assert params["bin"].min() == 0 and params["bin"].max() == 30
            assert_near(torch.bincount(params["bin"].flatten(), minlength=31) / draws, 1 / 31, draws)

    policy = batched("cifar10")
    params = policy.draw(count, generator)
    assert_near(torch.bincount(params["sub_policy"], minlength=25) / count, 1 / 25, count)
    probabilities = policy.sub_policy_probabilities[params["sub_policy"]]
    for probability in probabilities.unique().tolist():
        chosen = probabilities == probability
        assert_near(params["applied"][chosen].float().mean(), probability, chosen.sum())
    assert torch.equal(params["op"], policy.sub_policy_ops[params["sub_policy"]].where(params["applied"], 0))
    assert torch.equal(params["bin"], policy.sub_policy_bins[params["sub_policy"]])
    signed = policy.signed[params["op"]]
    assert not params["negate"][~signed].any()
    assert_near(params["negate"][signed].float().mean(), 0.5, signed.sum())

    policy = batched("augmix", severity=4)
    params = policy.draw(count, generator)
    depths = params["depth"].numel()
    assert_near(torch.bincount(params["depth"].flatten(), minlength=4)[1:] / depths, 1 / 3, depths)
    steps = torch.arange(3).repeat(3) < params["depth"].repeat_interleave(3, dim=1)
    assert (params["op"][~steps] == 0).all() and (params["op"][steps] > 0).all()
    assert_near(torch.bincount(params["op"][steps], minlength=14)[1:] / steps.sum(), 1 / 13, steps.sum())
    assert params["bin"].min() == 0 and params["bin"].max() == 3
    assert torch.allclose(params["mixing"].sum(1), torch.ones(count))
    assert torch.allclose(params["chains"].sum(1), torch.ones(count))
    assert_near(params["mixing"][:, 0].mean(), 0.5, 3 * count)  # Beta(1, 1): variance 1/12, a third of 1/4


@pytest.mark.parametrize("name", ["ra", "ta_wide", "imagenet", "augmix"])
def test_draws_come_from_the_generator_alone(name):
    policy = batched(name)

    def draw(seed):
        return policy.draw(64, torch.Generator().manual_seed(seed))

    torch.manual_seed(1)
    first = draw(5)
    torch.manual_seed(2)  # the global generator plays no part
    again, other = draw(5), draw(6)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["op"], other["op"])


def replay(policy, params, index, monkeypatch):
    """Make torchvision's forward draw image `index`'s ops from params: its torch.randint and torch.rand calls (and
    AugMix's Dirichlet draws) answer, in its own order, what gives our draw. Returns the queues, empty once
    torchvision consumed exactly them."""
    keys = list(policy.space)
    integers, uniforms = [], []
    op, bin, negate = (params[key][index].tolist() for key in ("op", "bin", "negate"))

    def draw_op(round, name):
        integers.append(keys.index(name))  # _get_random_item
        magnitudes, signed = policy.space[name]
        if magnitudes(policy.num_bins, 8, 8) is not None:
            if policy.policy != "ra":
                integers.append(bin[round])
            if signed:
                uniforms.append(0.25 if negate[round] else 0.75)

    if policy.policy in ("ra", "ta_wide"):
        for round in range(policy.num_rounds):
            draw_op(round, policy.op_names[op[round]])
    elif policy.policy == "augmix":
        for chain, depth in enumerate(params["depth"][index].tolist()):
            integers.append(depth)
            for step in range(depth):
                round = chain * policy.max_depth + step
                draw_op(round, policy.op_names[op[round]])
        dirichlet = [params["mixing"][index: index + 1], params["chains"][index: index + 1]]
        monkeypatch.setattr(policy.reference, "_sample_dirichlet", lambda alphas: dirichlet.pop(0))
    else:
        sub_policy = params["sub_policy"][index].item()
        integers.append(sub_policy)
        for round, applied in enumerate(params["applied"][index].tolist()):
            uniforms.append(0.0 if applied else 1.0)
            name = policy.reference._policies[sub_policy][round][0]
            magnitudes, signed = policy.space[name]
            if applied and signed and magnitudes(10, 8, 8) is not None:
                uniforms.append(0.25 if negate[round] else 0.75)
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: torch.tensor(integers.pop(0)))
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(uniforms.pop(0)))
    return integers, uniforms


@pytest.mark.parametrize("name, size", [("ra", (3, 24, 20)), ("ta_wide", (3, 21, 21)), ("imagenet", (3, 24, 20)),
                                        ("cifar10", (3, 15, 26)), ("svhn", (3, 24, 20)), ("augmix", (3, 17, 17))])
def test_each_image_gets_what_torchvisions_forward_gives_it_for_its_draws(name, size, monkeypatch):
    """The whole pipeline on a batch whose images drew different ops (RandAugment's two rounds, AutoAugment's
    sub-policies, AugMix's chains and mixing): each image is exactly what torchvision's class's forward gives it
    when its random numbers replay that image's draw."""
    policy = batched(name, num_ops=2, magnitude=9, severity=3, interpolation=BILINEAR)
    batch = images(8, size, seed=3)
    params = policy.draw(len(batch), torch.Generator().manual_seed(11))
    assert len(params["op"].unique()) >= 4  # the batch mixes ops
    out = policy.apply(batch, params)
    assert torch.equal(batch, images(8, size, seed=3))  # the caller's batch untouched
    changed = 0
    for i in range(len(batch)):
        with monkeypatch.context() as patch:
            integers, uniforms = replay(policy, params, i, patch)
            expected = policy.reference(batch[i])
        assert not integers and not uniforms  # torchvision drew exactly the replayed numbers
        assert torch.equal(out[i], expected), (i, params["op"][i].tolist())
        changed += not torch.equal(out[i], batch[i])
    assert changed >= 4
    torch.manual_seed(0)
    assert torch.equal(policy(batch, torch.Generator().manual_seed(11)), out)  # __call__ = apply(draw)

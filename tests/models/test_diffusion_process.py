"""The diffusion process against closed forms computed independently here: schedules, forward process,
DDPM posterior, ε/v parameterisations, min-SNR loss, learned variance and the variational bound, DDPM/DDIM
sampling of point-mass data, classifier-free guidance, and rectified flow."""

import math

import pytest
import torch

from mmformer.models.diffusion import (
    GaussianDiffusion,
    RectifiedFlow,
    beta_schedule,
    ddim_sample,
    ddpm_sample,
    guided,
)

T = 100
SHAPE = (3, 2, 4, 4)


def _betas():
    return beta_schedule("linear", T, 1e-3, 0.2)  # the DDPM range rescaled by 1000/T


def _alpha_bars(betas):
    out, prod = [], 1.0
    for b in betas.tolist():
        prod *= 1.0 - b
        out.append(prod)
    return torch.tensor(out, dtype=torch.float64)


def _bc(v, t):
    return v[t].reshape(-1, 1, 1, 1)


def _x0(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(SHAPE, generator=g, dtype=dtype) * 2 - 1) * 0.9


def _noise(seed=1, dtype=torch.float64):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# Schedules ---------------------------------------------------------------------------------------


def test_linear_schedule_endpoints_and_cumprod():
    betas = beta_schedule("linear", 1000)
    assert betas.dtype == torch.float64 and betas.shape == (1000,)
    assert betas[0].item() == pytest.approx(1e-4, abs=1e-15) and betas[-1].item() == pytest.approx(
        2e-2, abs=1e-15
    )
    assert torch.allclose(betas.diff(), torch.full((999,), (2e-2 - 1e-4) / 999, dtype=torch.float64))
    diff = GaussianDiffusion(betas)
    assert diff.num_timesteps == 1000
    assert torch.allclose(diff.alphas_cumprod, _alpha_bars(betas), rtol=1e-12, atol=0)


def test_cosine_schedule_matches_closed_form():
    s, n = 0.008, 1000
    betas = beta_schedule("cosine", n)

    def f(t):
        return math.cos((t / n + s) / (1 + s) * math.pi / 2) ** 2

    assert betas.max().item() == pytest.approx(0.999) and betas[-1].item() == pytest.approx(0.999)
    clipped = (betas >= 0.999).nonzero().min().item()
    assert clipped >= n - 2  # only the very end is clipped
    ac = GaussianDiffusion(betas).alphas_cumprod
    expected = torch.tensor([f(i + 1) / f(0) for i in range(clipped)], dtype=torch.float64)
    assert torch.allclose(ac[:clipped], expected, rtol=1e-9, atol=1e-15)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="linear.*cosine"):
        beta_schedule("quadratic")
    with pytest.raises(ValueError, match="eps"):
        GaussianDiffusion(_betas(), prediction="x0")
    with pytest.raises(ValueError, match="t_sampling"):
        RectifiedFlow(t_sampling="beta")


# Forward process and posterior -------------------------------------------------------------------


def test_q_mean_variance_and_posterior_closed_form():
    betas = _betas()
    diff = GaussianDiffusion(betas)
    ac = _alpha_bars(betas)
    ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
    x0, x_t = _x0(), _noise()
    t = torch.tensor([0, 1, 57])

    mean, var = diff.q_mean_variance(x0, t)
    assert torch.allclose(mean, _bc(ac.sqrt(), t) * x0)
    assert torch.allclose(var, (1 - _bc(ac, t)).expand_as(x0))

    beta_tilde = (1 - ac_prev) / (1 - ac) * betas
    coef1 = betas * ac_prev.sqrt() / (1 - ac)
    coef2 = (1 - ac_prev) * (1 - betas).sqrt() / (1 - ac)
    p_mean, p_var, p_logvar = diff.q_posterior(x0, x_t, t)
    assert torch.allclose(p_mean, _bc(coef1, t) * x0 + _bc(coef2, t) * x_t)
    assert torch.allclose(p_var, _bc(beta_tilde, t).expand_as(x0))
    assert p_var[0].abs().max() == 0  # β̃_0 = 0 ...
    assert torch.allclose(p_logvar[0], beta_tilde[1].log().expand_as(x0[0]))  # ... its log clipped to log β̃_1
    assert torch.allclose(p_logvar[1:], _bc(beta_tilde.log(), t[1:]).expand_as(x0[1:]))
    # at t = 0 the posterior mean is x0 itself
    assert torch.allclose(p_mean[0], x0[0])


@pytest.mark.parametrize("prediction", ["eps", "v"])
@pytest.mark.parametrize("learned_variance", [False, True])
def test_x0_and_eps_recovered_from_target(prediction, learned_variance):
    diff = GaussianDiffusion(_betas(), prediction=prediction, learned_variance=learned_variance)
    x0, noise = _x0(), _noise()
    t = torch.tensor([0, 40, T - 1])
    x_t = diff.q_sample(x0, t, noise)
    out = diff.training_target(x0, noise, t)
    if prediction == "v":
        ac = _bc(_alpha_bars(_betas()), t)
        assert torch.allclose(out, ac.sqrt() * noise - (1 - ac).sqrt() * x0)
    if learned_variance:
        out = torch.cat([out, torch.zeros_like(out)], dim=1)
    assert torch.allclose(diff.predict_x0(x_t, t, out), x0, atol=1e-5, rtol=0)
    assert torch.allclose(diff.predict_eps(x_t, t, out), noise, atol=1e-5, rtol=0)
    assert torch.allclose(diff.eps_from_x0(x_t, t, x0), noise, atol=1e-5, rtol=0)


def test_float32_inputs_stay_float32():
    diff = GaussianDiffusion(_betas(), prediction="v")
    x0, noise, t = _x0(dtype=torch.float32), _noise(dtype=torch.float32), torch.tensor([2, 30, 70])
    x_t = diff.q_sample(x0, t, noise)
    x0_hat = diff.predict_x0(x_t, t, diff.training_target(x0, noise, t))
    assert x_t.dtype == x0_hat.dtype == torch.float32
    assert torch.allclose(x0_hat, x0, atol=1e-5)


# Loss --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_loss_zero_on_target_and_min_snr_closed_form(prediction):
    diff = GaussianDiffusion(_betas(), prediction=prediction)
    x0, noise = _x0(), _noise()
    t = torch.tensor([1, 10, 80])
    target = diff.training_target(x0, noise, t)
    assert diff.loss(target, x0, noise, t).abs().max() == 0
    assert diff.loss(target, x0, noise, t, min_snr_gamma=5.0).abs().max() == 0

    out = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mse = ((out - target) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(diff.loss(out, x0, noise, t), mse)
    ac = _alpha_bars(_betas())[t]
    snr = ac / (1 - ac)
    assert torch.allclose(diff.snr(t), snr)
    gamma = 5.0
    assert snr[0] > gamma > snr[2]  # both branches of the min
    weight = torch.minimum(snr, torch.full_like(snr, gamma)) / (snr if prediction == "eps" else snr + 1)
    assert torch.allclose(diff.loss(out, x0, noise, t, min_snr_gamma=gamma), weight * mse)


# Learned variance and the variational bound ------------------------------------------------------


def test_learned_variance_interpolates_between_beta_and_posterior():
    betas = _betas()
    diff = GaussianDiffusion(betas, learned_variance=True)
    ac = _alpha_bars(betas)
    ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
    beta_tilde = (1 - ac_prev) / (1 - ac) * betas
    log_tilde_clipped = torch.cat([beta_tilde[1:2], beta_tilde[1:]]).log()
    x_t, t = _noise(), torch.tensor([0, 5, 99])
    eps = _noise(seed=4)
    for value, expected in ((1.0, betas.log()), (-1.0, log_tilde_clipped)):
        out = torch.cat([eps, torch.full_like(eps, value)], dim=1)
        res = diff.p_mean_variance(out, x_t, t)
        assert torch.allclose(res["log_variance"], _bc(expected, t).expand_as(x_t))
        assert torch.allclose(res["variance"], res["log_variance"].exp())
    mid = diff.p_mean_variance(torch.cat([eps, torch.zeros_like(eps)], dim=1), x_t, t)["log_variance"]
    assert torch.allclose(mid, _bc((betas.log() + log_tilde_clipped) / 2, t).expand_as(x_t))
    with pytest.raises(ValueError, match="channels"):
        diff.p_mean_variance(eps, x_t, t)


def test_p_mean_variance_fixed_small_and_clipping():
    diff = GaussianDiffusion(_betas())
    x0, noise, t = _x0(), _noise(), torch.tensor([3, 20, 60])
    x_t = diff.q_sample(x0, t, noise)
    res = diff.p_mean_variance(noise, x_t, t)
    mean, var, logvar = diff.q_posterior(x0, x_t, t)
    assert torch.allclose(res["pred_x0"], x0) and torch.allclose(res["mean"], mean)
    assert torch.allclose(res["variance"], var) and torch.allclose(res["log_variance"], logvar)
    wild = diff.p_mean_variance(noise + 5, x_t, t)["pred_x0"]
    assert wild.abs().max() <= 1
    assert diff.p_mean_variance(noise + 5, x_t, t, clip_x0=False)["pred_x0"].abs().max() > 1


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_vlb_nonnegative_and_zero_at_true_posterior(prediction):
    diff = GaussianDiffusion(_betas(), prediction=prediction, learned_variance=True)
    x0, noise = _x0(), _noise()
    t = torch.tensor([0, 7, 90])
    x_t = diff.q_sample(x0, t, noise)
    random_out = torch.randn((3, 4, 4, 4), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    random_out[:, 2:] = random_out[:, 2:].clamp(-1, 1)
    assert (diff.vlb(random_out, x0, x_t, t) >= 0).all()

    exact = torch.cat([diff.training_target(x0, noise, t), -torch.ones_like(x0)], dim=1)
    vlb = diff.vlb(exact, x0, x_t, t)
    assert vlb[0] > 0  # decoder NLL at t = 0
    assert torch.allclose(vlb[1:], torch.zeros(2, dtype=torch.float64), atol=1e-8)
    assert torch.allclose(diff.loss(exact, x0, noise, t)[1:], torch.zeros(2, dtype=torch.float64), atol=1e-8)


def test_hybrid_loss_stops_vlb_gradient_into_mean():
    diff = GaussianDiffusion(_betas(), learned_variance=True)
    x0, noise, t = _x0(), _noise(), torch.tensor([0, 15, 70])
    out = torch.randn((3, 4, 4, 4), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out[:, 2:] = out[:, 2:].tanh()
    out.requires_grad_(True)
    loss = diff.loss(out, x0, noise, t, min_snr_gamma=5.0)
    (grad,) = torch.autograd.grad(loss.sum(), out)
    mean = out[:, :2].detach().requires_grad_(True)
    plain = GaussianDiffusion(_betas()).loss(mean, x0, noise, t, min_snr_gamma=5.0)
    (grad_mean,) = torch.autograd.grad(plain.sum(), mean)
    assert torch.allclose(grad[:, :2], grad_mean)
    assert grad[:, 2:].abs().sum() > 0  # the bound does train the variance
    vlb = diff.vlb(out.detach(), x0, diff.q_sample(x0, t, noise), t)
    assert torch.allclose(loss.detach(), plain.detach() + vlb)


# Samplers ----------------------------------------------------------------------------------------


def _point_mass_eps(diff, x_star):
    ac = diff.alphas_cumprod

    def model_fn(x_t, t):
        a = _bc(ac, t).to(x_t.dtype)
        return (x_t - a.sqrt() * x_star) / (1 - a).sqrt()

    return model_fn


def test_ddim_deterministic_and_recovers_point_mass():
    diff = GaussianDiffusion(_betas())
    x_star = _x0(dtype=torch.float32)
    x_T = _noise(dtype=torch.float32)
    fn = _point_mass_eps(diff, x_star)
    a = ddim_sample(diff, fn, SHAPE, steps=10, generator=torch.Generator().manual_seed(1), x_T=x_T)
    b = ddim_sample(diff, fn, SHAPE, steps=10, generator=torch.Generator().manual_seed(2), x_T=x_T)
    assert torch.equal(a, b)
    assert torch.allclose(a, x_star, atol=1e-4)
    for steps, eta in ((1, 0.0), (T, 0.0), (7, 1.0)):
        out = ddim_sample(diff, fn, SHAPE, steps=steps, eta=eta, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(out, x_star, atol=1e-4)
    with pytest.raises(ValueError, match="steps"):
        ddim_sample(diff, fn, SHAPE, steps=T + 1)


def test_ddim_eta_zero_is_deterministic_for_a_generic_model():
    diff = GaussianDiffusion(_betas())
    x_T = _noise(dtype=torch.float32)

    def fn(x, t):
        return torch.sin(x) * 0.5

    a = ddim_sample(diff, fn, SHAPE, steps=5, generator=torch.Generator().manual_seed(1), x_T=x_T)
    b = ddim_sample(diff, fn, SHAPE, steps=5, generator=torch.Generator().manual_seed(2), x_T=x_T)
    c = ddim_sample(diff, fn, SHAPE, steps=5, eta=1.0, generator=torch.Generator().manual_seed(2), x_T=x_T)
    assert torch.equal(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize("learned_variance", [False, True])
def test_ddpm_recovers_point_mass(learned_variance):
    diff = GaussianDiffusion(_betas(), learned_variance=learned_variance)
    x_star = _x0(dtype=torch.float32)
    eps_fn = _point_mass_eps(diff, x_star)

    def fn(x, t):
        eps = eps_fn(x, t)
        return torch.cat([eps, torch.zeros_like(eps)], dim=1) if learned_variance else eps

    out = ddpm_sample(diff, fn, SHAPE, generator=torch.Generator().manual_seed(0))
    assert out.shape == SHAPE and out.dtype == torch.float32
    assert torch.allclose(out, x_star, atol=1e-4)


def test_ddpm_gaussian_data_has_the_data_spread():
    """Data N(0, s²): the exact ε̂ is E[ε | x_t] = sqrt(1-ᾱ) x_t / (ᾱ s² + 1 - ᾱ); ancestral samples must spread
    like the data (β̃ slightly under-disperses at T = 100), which fails if the noise or its scale is wrong."""
    diff, s = GaussianDiffusion(beta_schedule("cosine", T)), 0.5

    def fn(x, t):
        a = _bc(diff.alphas_cumprod, t).to(x.dtype)
        return (1 - a).sqrt() * x / (a * s * s + 1 - a)

    out = ddpm_sample(diff, fn, (20000, 1, 1, 1), generator=torch.Generator().manual_seed(0), clip_x0=False)
    assert abs(out.mean().item()) < 0.02
    assert 0.46 < out.std().item() < 0.52


# Classifier-free guidance ------------------------------------------------------------------------


def _cond_model(channels_out_factor=1):
    calls = []

    def fn(x, t, c):
        calls.append(x.shape[0])
        c = c.to(x.dtype).reshape(-1, 1, 1, 1)
        mean = x * (1 + c) + t.to(x.dtype).reshape(-1, 1, 1, 1) * 0.01
        return mean if channels_out_factor == 1 else torch.cat([mean, torch.cos(x + c)], dim=1)

    return fn, calls


def test_guidance_scale_one_is_plain_conditional():
    fn, calls = _cond_model()
    x, t = _noise(dtype=torch.float32), torch.tensor([3, 4, 5])
    cond, null = torch.tensor([1, 2, 0]), torch.full((3,), 7)
    out = guided(fn, cond, null, 1.0)(x, t)
    assert torch.equal(out, fn(x, t, cond))
    assert calls == [3, 3]  # one plain call each, no unconditional pass


@pytest.mark.parametrize("factor", [1, 2])
def test_guidance_formula(factor):
    fn, calls = _cond_model(factor)
    x, t = _noise(dtype=torch.float32), torch.tensor([3, 4, 5])
    cond, null, s = torch.tensor([1, 2, 0]), torch.full((3,), 7), 4.0
    out = guided(fn, cond, null, s)(x, t)
    assert calls == [6]  # one batched call on [cond; null]
    c_out, u_out = fn(x, t, cond), fn(x, t, null)
    assert out.shape == c_out.shape
    assert torch.allclose(out[:, :2], u_out[:, :2] + s * (c_out[:, :2] - u_out[:, :2]))
    if factor == 2:
        assert torch.equal(out[:, 2:], c_out[:, 2:])  # the variance half stays conditional


# Rectified flow ----------------------------------------------------------------------------------


def test_flow_interpolate_target_loss():
    flow = RectifiedFlow()
    x0, noise = _x0(), _noise()
    assert torch.equal(flow.interpolate(x0, noise, torch.zeros(3)), x0)
    assert torch.equal(flow.interpolate(x0, noise, torch.ones(3)), noise)
    t = torch.tensor([0.25, 0.5, 0.9])
    tb = t.to(torch.float64).reshape(-1, 1, 1, 1)
    assert torch.allclose(flow.interpolate(x0, noise, t), (1 - tb) * x0 + tb * noise)
    assert torch.equal(flow.target(x0, noise), noise - x0)
    assert flow.loss(noise - x0, x0, noise).abs().max() == 0
    assert torch.allclose(flow.loss(noise, x0, noise), (x0**2).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
def test_flow_sample_t(kind):
    t = RectifiedFlow(t_sampling=kind).sample_t(4096, generator=torch.Generator().manual_seed(0))
    assert t.shape == (4096,) and t.dtype == torch.float32
    assert (t >= 0).all() and (t <= 1).all()
    assert abs(t.mean().item() - 0.5) < 0.02
    if kind == "logit_normal":  # concentrated in the middle compared to uniform (var 1/12)
        assert t.var().item() < 1 / 12 - 0.01


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_flow_samplers_recover_point_mass(steps):
    flow = RectifiedFlow()
    x_star = _x0(dtype=torch.float32)
    seen = []

    def velocity(x, t):
        seen.append(t)
        return (x - x_star) / t.reshape(-1, 1, 1, 1)  # ε - x* along the straight path through x

    out = flow.euler_sample(velocity, SHAPE, steps=steps, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, x_star, atol=1e-5)
    assert len(seen) == steps and all(s.dtype == torch.float32 and s.shape == (3,) for s in seen)
    seen.clear()
    out = flow.heun_sample(velocity, SHAPE, steps=steps, x_1=_noise(dtype=torch.float32))
    assert torch.allclose(out, x_star, atol=1e-5)
    assert len(seen) == 2 * steps - 1


def test_schedule_tables_stay_float64_when_the_model_is_cast_to_bf16():
    d = GaussianDiffusion(beta_schedule("linear", 100))
    ref = d.alphas_cumprod.clone()
    d.to(torch.bfloat16)
    assert d.alphas_cumprod.dtype == torch.float64 and torch.equal(d.alphas_cumprod, ref)

"""The closed-form gradient of the fused CE + L1 terms (train/losses.py:ce_l1_terms) equals
autodiff through log_softmax → exp → |·| (the textbook definition), values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.train.losses import ce_l1_terms


def reference(d_logits, t_probs, labels):
    logp = jax.nn.log_softmax(d_logits, axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(jnp.exp(logp) - t_probs), axis=-1)
    return ce, l1


def test_fused_terms_and_gradients_equal_autodiff():
    rng = np.random.RandomState(0)
    shape, V = (2, 3, 4), 37
    d_logits = jnp.asarray(rng.randn(*shape, V) * 3, jnp.float32)
    t_probs = jax.nn.softmax(jnp.asarray(rng.randn(*shape, V) * 3, jnp.float32), axis=-1)
    labels = jnp.asarray(rng.randint(0, V, shape), jnp.int32)
    w_ce = jnp.asarray(rng.rand(*shape), jnp.float32)
    w_l1 = jnp.asarray(rng.rand(*shape), jnp.float32) * (rng.rand(*shape) > 0.3)

    def objective(fn):
        def f(z):
            ce, l1 = fn(z, t_probs, labels)
            return jnp.sum(w_ce * ce) + 0.7 * jnp.sum(w_l1 * l1)
        return f

    for got, want in zip(ce_l1_terms(d_logits, t_probs, labels),
                         reference(d_logits, t_probs, labels)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    g_fused = jax.jit(jax.grad(objective(ce_l1_terms)))(d_logits)
    g_ref = jax.grad(objective(reference))(d_logits)
    assert float(jnp.max(jnp.abs(g_ref))) > 1e-2        # a real gradient, not all zeros
    np.testing.assert_allclose(g_fused, g_ref, rtol=1e-5, atol=1e-6)

// Reference optimizers in double, written from the papers' formulas, for the optim tests.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace strata::test::optim {

/// SGD as the PyTorch documentation states it: g <- g + wd * p; b_1 = g,
/// b_t = mu * b_{t-1} + (1 - d) * g; g <- g + mu * b_t (Nesterov) or b_t; p <- p - lr * g.
struct reference_sgd {
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  std::vector<double> buf;

  void step(std::vector<double>& p, std::vector<double> const& grad, double lr, long t,
            double grad_scale) {
    buf.resize(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = grad[i] * grad_scale + weight_decay * p[i];
      if (momentum != 0) {
        buf[i] = t == 1 ? g : momentum * buf[i] + (1 - dampening) * g;
        g = nesterov ? g + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * g;
    }
  }
};

/// AdamW (Loshchilov & Hutter, Algorithm 2, with PyTorch's placement of eps and of the
/// decay): p <- p - lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// p <- p - lr * m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t).
struct reference_adamw {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::vector<double> m;
  std::vector<double> v;

  void step(std::vector<double>& p, std::vector<double> const& grad, double lr, long t,
            double grad_scale) {
    m.resize(p.size());
    v.resize(p.size());
    double const c1 = 1 - std::pow(beta1, static_cast<double>(t));
    double const c2 = 1 - std::pow(beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      double const g = grad[i] * grad_scale;
      p[i] -= lr * weight_decay * p[i];
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      double const m_hat = m[i] / c1;
      double const v_hat = v[i] / c2;
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

} // namespace strata::test::optim

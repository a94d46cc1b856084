"""tf_keras `fit` in v1 graph mode under MirroredStrategy on 2 virtual CPUs: `compile` makes the
session before `fit` adds the training ops (issue 38 §2). `python keras_mirrored_fit.py OUT.npz`.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402
from tf_keras.src import backend  # noqa: E402

tf1 = tf.compat.v1


def main(out: str) -> None:
    tf1.disable_eager_execution()
    backend.set_session(tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 2})))
    keras.utils.set_random_seed(0)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = keras.Sequential([
            keras.layers.Conv2D(4, 3, use_bias=False, input_shape=(6, 6, 3)), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
        model.compile(keras.optimizers.legacy.SGD(0.1), "mse")
    images = np.random.RandomState(1).normal(1, 2, (16, 6, 6, 3)).astype(np.float32)
    targets = np.random.RandomState(2).normal(0, 1, (16, 3)).astype(np.float32)
    model.fit(images, targets, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.savez(out, *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1])

"""Two towers on /cpu:0 and /cpu:1, synchronized batch norm; after two training steps the script
fetches tower 0's loss alone: its all-reduce waits for tower 1's member, which that run never runs."""
import os, sys, time
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
tf1 = tf.compat.v1
tf1.disable_eager_execution()
feeds, losses = [], []
opt = tf1.train.GradientDescentOptimizer(0.1)
grads = []
for k in range(2):
    with tf1.device(f"/cpu:{k}"), tf1.name_scope(f"tower_{k}"):
        x = tf1.placeholder(tf.float32, [4, 6, 6, 3])
        with tf1.variable_scope("net", reuse=tf1.AUTO_REUSE):
            h = tf1.layers.conv2d(x, 4, 3, padding="same", use_bias=False, name="conv")
            h = tf1.layers.batch_normalization(h, training=True, name="bn1")
            loss = tf.reduce_mean(tf.square(h))
        grads.append(opt.compute_gradients(loss))
        feeds.append(x); losses.append(loss)
avg = [(tf.add_n([g for g, _ in gv]) / 2, gv[0][1]) for gv in zip(*grads)]
with tf1.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
    train = opt.apply_gradients(avg)
rng = np.random.RandomState(0)
feed = {x: rng.standard_normal((4, 6, 6, 3)).astype(np.float32) for x in feeds}
with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 2})) as sess:
    sess.run(tf1.global_variables_initializer())
    for step in range(2):
        print("step", step, sess.run([train, losses[0]], feed)[1], flush=True)
    start = time.monotonic()
    print("tower 0's loss alone ...", flush=True)
    print(sess.run(losses[0], feed))
    print("returned after", time.monotonic() - start)

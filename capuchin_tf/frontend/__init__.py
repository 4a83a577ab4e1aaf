"""The front ends: the `capuchin_tf.function` decorator and the Keras `CapuchinCallback`."""

package flightdeck.spark;

import java.util.Map;
import java.util.StringJoiner;
import org.apache.arrow.vector.types.pojo.ArrowType;
import org.apache.arrow.vector.types.pojo.Field;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * {@code format("flightdeck")}: writes a DataFrame into a flightdeck
 * dataset exactly once per partition, and reads a sealed dataset back.
 *
 * <pre>
 * df.write.format("flightdeck")
 *   .option("uri", "local")            // each executor's own node server
 *   .option("dataset", "clicks")
 *   .mode("overwrite")                  // or "append": a new dataset only
 *   .save()
 * spark.read.format("flightdeck").option("uri", "node7").option("dataset", "clicks").load()
 * </pre>
 *
 * See {@link Options} for every option and {@link FlightDeckWrite} for the
 * commit rule.
 */
public final class FlightDeckDataSource implements TableProvider, DataSourceRegister {
  /** For Spark's service loader. */
  public FlightDeckDataSource() {}

  @Override
  public String shortName() {
    return "flightdeck";
  }

  /** A read without a given schema: the dataset's own, from its server. */
  @Override
  public StructType inferSchema(CaseInsensitiveStringMap map) {
    Options options = Options.of(map);
    try (Server server = Server.open(options.uri(), options.token())) {
      StructType out = new StructType();
      for (Field field : server.sealed(options.dataset()).arrowSchema().getFields()) {
        out = out.add(field.getName(), sparkType(field, options.dataset(), server.location),
            field.isNullable());
      }
      return out;
    }
  }

  /**
   * The Spark type of a stored column (see {@link SparkTypes}); refused,
   * naming the column, where Spark has none.
   */
  static DataType sparkType(Field field, String dataset, String location) {
    SparkTypes.Read read = SparkTypes.read(field);
    if (read == null) {
      throw new FlightDeckException("INVALID_ARGUMENT", "column '" + field.getName()
          + "' of dataset '" + dataset + "' on " + location + " is " + typeName(field)
          + ", which Spark cannot hold; give the read a schema that reads it as a type it is "
          + "cast to, or without it, e.g. spark.read.schema(\"id long\")");
    }
    return read.type();
  }

  /** A stored column's type as Arrow's other libraries name it ({@code uint32}). */
  static String typeName(Field field) {
    if (field.getType() instanceof ArrowType.Int i) {
      return (i.getIsSigned() ? "int" : "uint") + i.getBitWidth();
    }
    if (field.getType() instanceof ArrowType.Decimal d && d.getBitWidth() == 256) {
      return "decimal256(" + d.getPrecision() + ", " + d.getScale() + ")";
    }
    return field.getType().toString();
  }

  /**
   * The dataset as a table. Partition columns ({@code partitionBy},
   * {@code clusterBy}, {@code PARTITIONED BY}) are refused: a dataset's partitions are the
   * DataFrame's, one a task, and Spark would otherwise say only that they
   * do not match the table's.
   */
  @Override
  public Table getTable(
      StructType schema, Transform[] partitioning, Map<String, String> properties) {
    Options options = Options.of(properties);
    if (partitioning.length > 0) {
      StringJoiner columns = new StringJoiner(", ");
      for (Transform t : partitioning) {
        columns.add(t.describe());
      }
      throw new IllegalArgumentException("dataset '" + options.dataset() + "' cannot be "
          + "partitioned by columns (" + columns + "): a flightdeck dataset's partitions are "
          + "the DataFrame's, one a Spark task; leave out partitionBy and clusterBy (PARTITIONED "
          + "BY, CLUSTER BY), and "
          + "repartition the DataFrame to group rows by a column: df.repartition(n, col(\"k\"))");
    }
    return new FlightDeckTable(options, schema);
  }

  /** Writes take the DataFrame's schema. */
  @Override
  public boolean supportsExternalMetadata() {
    return true;
  }
}
